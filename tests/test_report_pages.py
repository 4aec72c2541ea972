"""Report pages (SIMULATION.md, RECOVERY.md, ...) are written only over a page of their own:
``files.page_refusal``/``write_page`` and every script's ``--out``."""

from __future__ import annotations

import os

import pytest
from helpers import SCRIPTS, assert_names, raises_naming, script_module

from lm_eval_headloc.common.files import page_refusal, write_page

ROOT = SCRIPTS.parent

THEIRS = "# My own notes\n\nnot a report\n"


def test_a_new_an_empty_or_an_own_page_may_be_written(tmp_path):
    assert page_refusal(tmp_path / "new.md", "# Title") is None
    (tmp_path / "empty.md").write_text("")
    assert page_refusal(tmp_path / "empty.md", "# Title") is None
    (tmp_path / "own.md").write_text("# Title and more\n")
    assert page_refusal(tmp_path / "own.md", ("# Other", "# Title")) is None


def test_anything_else_is_refused_in_one_line_naming_the_path(tmp_path):
    theirs = tmp_path / "theirs.md"
    theirs.write_text(THEIRS)
    why = page_refusal(theirs, "# Title")
    assert why is not None and str(theirs) in why and "'# Title'" in why and "\n" not in why
    assert_names(page_refusal(tmp_path, "# Title"), str(tmp_path), str(tmp_path / "page.md"))
    # In a folder that is not there (or is a file): refused before any work, not at its end.
    assert_names(page_refusal(tmp_path / "missing" / "page.md", "# Title"),
                 str(tmp_path / "missing"))
    assert_names(page_refusal(theirs / "page.md", "# Title"), str(theirs))
    assert (tmp_path / "theirs.md").read_text() == THEIRS and not (tmp_path / "missing").exists()
    # A longer beginning than the file: a prefix of the title is not the title.
    (tmp_path / "short.md").write_text("# Ti")
    assert page_refusal(tmp_path / "short.md", "# Title") is not None


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_refused(tmp_path):
    locked = tmp_path / "locked.md"
    locked.write_text("# Title\n")
    locked.chmod(0)
    try:
        why = page_refusal(locked, "# Title")  # it begins as asked: unreadable is why
        assert why is not None
        assert_names(why, str(locked))
    finally:
        locked.chmod(0o600)


def test_write_page_replaces_its_own_page_and_refuses_another(tmp_path):
    page = tmp_path / "page.md"
    write_page(page, "# Title\n\none\n", "# Title")
    write_page(page, "# Title\n\ntwo\n", "# Title")
    assert page.read_text() == "# Title\n\ntwo\n"
    page.write_text(THEIRS)  # changed while a long run worked: checked again at the write
    with raises_naming(FileExistsError, str(page), "'# Title'"):
        write_page(page, "# Title\n\nthree\n", "# Title")
    assert page.read_text() == THEIRS
    # A page that does not begin as it says: the next run would refuse it.
    with raises_naming(ValueError, str(tmp_path / "other.md"), "'# Title'"):
        write_page(tmp_path / "other.md", "# Another\n", "# Title")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md"]  # no partial file left


#: script, arguments before --out, its committed page, the module's beginning constant.
SCRIPT_PAGES = [
    ("simulate_recovery", [], "SIMULATION.md", "TITLE"),
    ("budget_split", [], "docs/budget_split.md", "TITLE"),
    ("bench_recovery", [], "RECOVERY.md", "TITLE"),
    ("bench_neurons", [], "NEURONS.md", "TITLE"),
    ("compare_ablations", ["{tmp}"], "docs/ablation_kinds.md", "TITLE"),
    ("gen_cli_docs", [], "docs/cli.md", "BEGINS"),
    ("bench_measure", [], "BENCH.md", None),
    ("bench_workers", [], "BENCH.md", None),
]


@pytest.mark.parametrize(("name", "before", "page", "constant"), SCRIPT_PAGES,
                         ids=[s[0] for s in SCRIPT_PAGES])
def test_every_script_refuses_a_foreign_out_before_any_work(tmp_path, capsys, name, before,
                                                            page, constant):
    script = script_module(name)
    theirs = tmp_path / "notes.md"
    theirs.write_text(THEIRS)
    argv = [arg.format(tmp=tmp_path) for arg in before]
    for target in (theirs, tmp_path):
        with pytest.raises(SystemExit) as stopped:
            script.main([*argv, "--out", str(target)])
        assert stopped.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and str(target) in errors[0], errors
    assert theirs.read_text() == THEIRS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]
    # The page the script committed begins as the script checks, so a rerun may replace it.
    if constant is None:
        assert script_module("bench_sections").bench_refusal(ROOT / page) is None
    else:
        assert page_refusal(ROOT / page, getattr(script, constant)) is None
