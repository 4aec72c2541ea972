"""The documentation stays true to the code: docs/cli.md is the parser's current rendering,
every relative link in the guide and docs resolves (anchors included), the README's first
screen holds the whole first-use path, and the package's sources do not cite the project's
internal planning documents (which a user of the package cannot see)."""

from __future__ import annotations

import importlib.util
import json
import re
import unicodedata
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "scripts" / "gen_cli_docs.py"


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            ROOT / "benchmarks" / "README.md"]


def _pages() -> list[Path]:
    """Every Markdown page a reader copies commands from: the guide's, the top-level
    results pages, docs/ and the benchmarks' and examples' READMEs."""
    return [*sorted(ROOT.glob("*.md")), *_markdown_files()[1:],
            ROOT / "examples" / "README.md"]


@pytest.fixture(scope="module")
def gen_cli_docs() -> ModuleType:
    # scripts/ is not a package: load the generator from its file, as CI runs it.
    spec = importlib.util.spec_from_file_location("gen_cli_docs", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- docs/cli.md is generated ----------------------------------------------------------

def test_cli_reference_is_current(gen_cli_docs: ModuleType) -> None:
    problem = gen_cli_docs.check(gen_cli_docs.OUT)
    assert problem is None, problem


def test_cli_reference_covers_every_option(gen_cli_docs: ModuleType) -> None:
    import argparse

    from lm_eval_headloc.cli.main import build_parser

    text = gen_cli_docs.render()
    assert text == gen_cli_docs.render()  # deterministic
    assert "do not edit" in text.splitlines()[0]
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        section = text.split(f"## `headloc-harness {name}`", 1)[1].split("\n## ", 1)[0]
        for action in command._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in section, f"{name} {flag} missing from docs/cli.md"
            # An option argparse requires is said to be, in the usage line and its entry
            # (export's --out read "(default: not set)": an audit found it).
            if action.required and action.option_strings:
                flag = action.option_strings[0]
                usage = section.split("```")[1]
                entry = next(line for line in section.splitlines()
                             if line.startswith(f"- `{flag}"))
                assert flag in usage and entry.endswith("(required)"), (name, flag)
    assert any(a.required and a.option_strings for a in sub.choices["export"]._actions)


def test_stale_cli_reference_is_refused(gen_cli_docs: ModuleType, tmp_path: Path) -> None:
    stale = tmp_path / "cli.md"
    stale.write_text(gen_cli_docs.render().replace("(default: 300)", "(default: 301)"))
    problem = gen_cli_docs.check(stale)
    assert problem is not None and "python scripts/gen_cli_docs.py" in problem
    assert gen_cli_docs.main(["--check", "--out", str(stale)]) == 1
    assert gen_cli_docs.main(["--check", "--out", str(tmp_path / "missing.md")]) == 1
    assert gen_cli_docs.main(["--out", str(stale)]) == 0  # regenerating fixes it
    assert gen_cli_docs.main(["--check", "--out", str(stale)]) == 0


# --- links -------------------------------------------------------------------------------

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.M)
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.I)


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the rendered text lower-cased, punctuation other
    than '-' and '_' dropped, spaces made hyphens (github-slugger's rule)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN"
                   or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers: its headings' slugs (a repeated heading gets
    -1, -2, … as on GitHub) and explicit HTML anchors."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(text):
        slug = github_slug(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found | set(_HTML_ANCHOR.findall(text))


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of a Markdown file that do not resolve: a missing file or folder,
    or an anchor no heading of the target has (named relative to ``root``). External
    links are not checked."""
    text = _prose(path.read_text(encoding="utf-8"))
    problems = []
    for target in [*_LINK.findall(text), *_REFERENCE.findall(text)]:
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return problems


@pytest.mark.parametrize("path", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert path.is_file()
    assert broken_links(path) == []


def test_link_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# The `heads.json` file\n\n## Sign of effect\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n"
        "[ok](other.md) [ok](other.md#the-headsjson-file) [ok](other.md#sign-of-effect)\n"
        "[ok](#top) [external](https://example.com/missing) ![img](other.md)\n"
        "`[not a link](nowhere.md)`\n\n```\n[not a link](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [bad local](#bottom)\n\n"
        "[ref]: also-missing.md\n")
    assert broken_links(page, root=tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nope (no such heading)",
        "page.md: #bottom (no such heading)",
        "page.md: also-missing.md (no such file)",
    ]


def test_github_slugs() -> None:
    assert github_slug("`hf-headablate`: an lm-eval model") == "hf-headablate-an-lm-eval-model"
    assert github_slug("Many GPUs and nodes: `--workers N` (Ray)") == \
        "many-gpus-and-nodes---workers-n-ray"
    assert github_slug("The sign of `effect`") == "the-sign-of-effect"
    assert github_slug("heads_per_layer × 2") == "heads_per_layer--2"


# --- commands shown in the docs ------------------------------------------------------------

def shown_commands(path: Path) -> list[str]:
    """Every ``headloc-harness …`` command line of a Markdown file's bash/sh code blocks,
    continuation lines joined, and every one in a code span of its prose that has options
    and no placeholder for the reader to fill in (``RUN``, ``TASK``, ``…``): a span of a
    command's name alone names it."""
    text = path.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"^ *```(?:bash|sh|shell)\n(.*?)^ *```", text, re.M | re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.strip().startswith("headloc-harness "):
                commands.append(line.strip())
    for span in re.findall(r"(?<!`)`(headloc-harness [^`]+)`(?!`)", _FENCE.sub("", text)):
        words = span.split()
        if len(words) > 2 and not any(re.search(r"^[A-Z][A-Z_]*$|[<>\[…]", word)
                                      for word in words):
            commands.append(" ".join(words))
    return commands



def test_shown_commands_parse() -> None:
    """An example with an option the command does not have (renamed, removed) fails here,
    not in a reader's terminal. Parsing loads nothing."""
    import shlex

    from lm_eval_headloc.cli.main import build_parser

    parser = build_parser()
    shown = [(path, line) for path in _pages() for line in shown_commands(path)]
    assert len(shown) >= 30  # the README's and the docs' examples are found
    assert any(path.name == "RECOVERY.md" for path, _ in shown)  # code spans too
    for path, line in shown:
        try:
            parser.parse_args(shlex.split(line, comments=True)[1:])
        except SystemExit as exit_:
            if exit_.code != 0:  # 0: --version, --help
                pytest.fail(f"{path.relative_to(ROOT)}: `{line}` does not parse")


_BENCH_COMMAND = re.compile(r"python benchmarks/(\w+)\.py((?:[ \t]+[^\s`\"'#)]+)*)")
# A word that stands for a value the reader fills in (FROM, OUT_DIR, [NAME ...], <work>).
_PLACEHOLDER = re.compile(r"^[A-Z_]{2,}$|^\[|[<>]")


def shown_bench_commands() -> list[tuple[str, str, str]]:
    """Every ``python benchmarks/NAME.py ARGS`` of the pages (code blocks and code spans)
    and of the benchmarks' docstrings, continuation lines joined: (where, NAME, ARGS);
    commands with a placeholder for the reader to fill in are left out."""
    import ast

    texts = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
             for p in _pages()]
    for path in sorted((ROOT / "benchmarks" / "headloc_bench").glob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        texts.append((str(path.relative_to(ROOT)), docstring or ""))
    found = []
    for where, text in texts:
        for name, args in _BENCH_COMMAND.findall(re.sub(r"\\\n[ \t]*", " ", text)):
            if not any(_PLACEHOLDER.search(word) for word in args.split()):
                found.append((where, name, args.strip()))
    return found


def test_shown_benchmark_commands_parse(monkeypatch) -> None:
    """A benchmark command a page or a benchmark's docstring shows is parsed by that
    benchmark's own parser (compare_certified's docstring left out its required --out).
    Parsing only: the parser's answer is caught before the benchmark does anything."""
    import argparse
    import contextlib
    import io
    import shlex

    from helpers import bench_module

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    shown = shown_bench_commands()
    assert len(shown) >= 30 and any(w.endswith(".py") for w, _, _ in shown)
    failed = []
    for where, name, args in shown:
        main = bench_module(name).main
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                main(shlex.split(args))
        except Parsed:
            continue
        except SystemExit as exit_:
            if exit_.code == 0 and "--help" in args.split():
                continue
        failed.append(f"{where}: python benchmarks/{name}.py {args}: "
                      f"{errors.getvalue().strip().splitlines()[-1:]}")
    assert not failed, "\n".join(failed)


# --- the README's first screen -----------------------------------------------------------

def test_readme_first_screen_has_the_whole_first_use() -> None:
    """Install, the default job, the test command and the four steps for one's own model
    and task, within the first 40 lines."""
    first = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:40])
    for needed in ("bash scripts/run_default.sh", "bash scripts/test.sh", "task:",
                   "headloc-harness locate", "headloc-harness verify",
                   "lm_eval --model hf-headablate", "ablate_file=runs/"):
        assert needed in first, f"README's first 40 lines lack {needed!r}"


# --- the sources ---------------------------------------------------------------------------

_PLANNING = re.compile(r"SPEC\s*§|\bissues?\s+#?\d+", re.I)


def test_sources_do_not_cite_planning_documents() -> None:
    """'SPEC §2' or 'issue 10' in a docstring points a user at documents they do not have;
    the sources say what they mean instead."""
    hits = []
    sources = [*(ROOT / "lm_eval_headloc").rglob("*"), *(ROOT / "scripts").rglob("*"),
               *(p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".sh")),
               *(p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_docs.py")]
    for path in sorted(sources):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary data files
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if _PLANNING.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "planning references in the sources:\n" + "\n".join(hits)


def test_flags_that_keep_the_runs_value_say_so_not_the_fields_default() -> None:
    from lm_eval_headloc.cli.main import build_parser

    parser = build_parser()
    verify = next(a for a in parser._subparsers._group_actions).choices["verify"]
    helps = {a.dest: a.help for a in verify._actions}
    for dest in ("ablation_data", "ablation_field"):
        assert helps[dest].endswith("(default: the run's)"), helps[dest]
        assert helps[dest].count("default:") == 1
    # Every refit option keeps the run's value; --masks' help said locate's default
    # ("12 with an attribution prior, ..."), its nested parentheses not dropped.
    refit = next(a for a in parser._subparsers._group_actions).choices["refit"]
    options = [a for a in refit._actions if a.option_strings and a.dest != "help"]
    assert "masks" in {a.dest for a in options}
    for action in options:
        assert action.help.endswith("(default: the run's)"), (action.dest, action.help)
        assert action.help.count("default:") == 1, action.help


def test_the_main_job_installs_no_test_extras_and_the_test_command_does() -> None:
    """The main job installed pytest, ruff and Ray (`.[test]`, 2.3 GB of venv) to run one
    command; the test command must install them itself (CI runs it on a fresh clone)."""
    import subprocess

    scripts = ROOT / "scripts"
    calls = {name: [line.split() for line in (scripts / name).read_text().splitlines()
                    if line.startswith("bash scripts/setup.sh")]
             for name in ("run_default.sh", "test.sh")}
    assert calls == {"run_default.sh": [["bash", "scripts/setup.sh"]],
                     "test.sh": [["bash", "scripts/setup.sh", "--test"]]}
    text = (scripts / "setup.sh").read_text()
    assert 'install -e ".$EXTRAS"' in text and 'EXTRAS="[test]"' in text
    refused = subprocess.run(["bash", str(scripts / "setup.sh"), "--tests"],
                             capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                                  "HEADLOC_VENV": "/nonexistent"})
    assert refused.returncode == 2 and "'--tests'" in refused.stderr


def test_run_folder_docs_certificate_is_the_committed_default_runs(committed_benchmarks
                                                                   ) -> None:
    """docs/run-folder.md's example heads.json of "the default run" held certificate
    numbers a default run no longer gave (ruled_out 60 vs 123, group_size 4 vs 16): its
    numbers are those of the committed default run (the benchmark's certified run of
    headloc_induction, design seed 0: the main job's task, design and examples)."""
    text = (ROOT / "docs" / "run-folder.md").read_text()
    example = text[text.index('  "certificate": {'):text.index('"prior_top_k"')]
    shown = {key: json.loads(value) for key, value in
             re.findall(r'"(\w+)": (-?[0-9.]+|true|false|null)', example)}
    run = committed_benchmarks / "recovery-runs" / "headloc_induction" / "certified" / "seed0"
    certificate = json.loads((run / "heads.json").read_text())["certificate"]
    compared = {key: value for key, value in shown.items() if key in certificate}
    assert len(compared) >= 15  # the group test's own "change" and "se" aside
    for key, value in compared.items():
        actual = certificate[key]
        if isinstance(value, float):
            assert actual == pytest.approx(value, abs=5e-4), key
        else:
            assert actual == value, key


def test_run_folder_docs_name_every_config_key() -> None:
    """Every top-level key config.json is written with is named in run-folder.md's
    config.json section (`masks_per_pass`, which --masks-per-pass's help says config.json
    records, was not)."""
    from lm_eval_headloc.runs.record import LocateRun, RunRecord

    text = (ROOT / "docs" / "run-folder.md").read_text(encoding="utf-8")
    section = text.split("\n## `config.json`\n", 1)[1].split("\n## ", 1)[0]
    missing = [key for key in ("schema", *RunRecord.KEYS, *LocateRun.KEYS)
               if f"`{key}`" not in section]
    assert not missing, f"docs/run-folder.md's config.json section lacks {missing}"


def test_compare_certifieds_tasks_generate_nothing_as_its_docstring_says() -> None:
    """compare_certified's docstring called headloc_arith a generating task: every task it
    runs is scored by log-likelihood (a multiple choice included)."""
    from helpers import bench_module

    module = bench_module("compare_certified")
    assert "none generates" in module.__doc__
    for task in (*module.TASKS, *module.HELD_OUT):
        config = (ROOT / "task_configs" / task / f"{task}.yaml").read_text(encoding="utf-8")
        kind = re.search(r"^output_type: (\w+)$", config, re.M)
        assert kind is not None and kind.group(1) in ("loglikelihood", "multiple_choice"), task


def test_run_folder_docs_name_every_option_a_resume_may_change() -> None:
    """run-folder.md's list of the options a resumed locate, greedy or verify may change is
    RunSpec's (``refittable``): it left out locate's --group-tests and --max-measurements,
    which a rerun takes."""
    from lm_eval_headloc.runs.option_values import flag_of
    from lm_eval_headloc.runs.spec import RunSpec

    text = (ROOT / "docs" / "run-folder.md").read_text(encoding="utf-8")
    sentence = " ".join(text.split("never matter; ", 1)[1].split(" (a larger number")[0]
                        .split())
    spans = {command: sentence.split(f"`{command}`", 1)[1] for command in
             ("locate", "greedy", "verify")}
    spans["locate"] = spans["locate"].split("`greedy`")[0]
    spans["greedy"] = spans["greedy"].split("`verify`")[0]
    for command, span in spans.items():
        named = set(re.findall(r"`(--[a-z-]+)`", span))
        assert named == {flag_of(name) for name in RunSpec().refittable(command)}, command


def test_run_folder_docs_files_table_names_every_file_the_commands_write() -> None:
    """run-folder.md's table of files names every entry of ``WRITTEN`` — what ``--force``
    deletes as the commands' own: types.json, types.csv, lm_eval_files.json and timing.json
    were missing, so a reader could not tell that --force deletes a file of that name."""
    from lm_eval_headloc.runs.folder import WRITTEN

    text = (ROOT / "docs" / "run-folder.md").read_text(encoding="utf-8")
    table = text.split("\n## Files\n", 1)[1].strip().split("\n\n", 1)[0]
    named = set(re.findall(r"`([^`]+)`", "\n".join(line.split(" | ")[0] for line in
                                                   table.splitlines())))
    shown = {name.replace("<task>", "*").rstrip("/") for name in named}
    assert set(WRITTEN) <= shown, sorted(set(WRITTEN) - shown)


def test_benchmarks_size_said_is_the_archives(committed_benchmarks) -> None:
    """benchmarks/README.md and bench_store's docstring say how many files and megabytes the
    archives unpack to (they said 2,000 files and 80 MB after the archives had grown to
    2,270 and 92, and "under 7 MB" packed at 7.08): within a tenth of what they are."""
    from helpers import bench_module

    files = [p for p in committed_benchmarks.rglob("*") if p.is_file()]
    megabytes = sum(p.stat().st_size for p in files) / 1e6
    packed = sum(p.stat().st_size for p in (ROOT / "benchmarks").rglob("*.tar.xz")) / 1e6
    for where, text in (("benchmarks/README.md",
                         (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")),
                        ("bench_store.py", bench_module("bench_store").__doc__)):
        said = re.search(r"about ([\d,]+) files,? \(?(\d+) MB", text)
        assert said is not None, where
        count, size = int(said.group(1).replace(",", "")), int(said.group(2))
        assert abs(count - len(files)) <= 0.1 * len(files), (where, count, len(files))
        assert abs(size - megabytes) <= 0.1 * megabytes, (where, size, megabytes)
        said = re.search(r"about (\d+) MB (?:packed|in all)", " ".join(text.split()))
        assert said is not None, where
        assert abs(int(said.group(1)) - packed) <= 0.1 * packed, (where, packed)


def test_results_page_says_what_the_certified_simulation_shows() -> None:
    """docs/results.md's summary of SIMULATION.md's `certified` section: its command is the
    one the section records, and its counts of runs certified within the default cap are
    the table's (it said 9 of 10 with the prior at 1,024 and 4,096 heads and none without
    one, of an earlier render; the table says 10, 10, 9 and 9)."""
    table = (ROOT / "SIMULATION.md").read_text(encoding="utf-8").split(
        "<!-- certified: start -->", 1)[1]
    command = re.search(r"by `(python benchmarks/simulate_certified\.py [^`]+)`", table)
    text = " ".join((ROOT / "docs" / "results.md").read_text(encoding="utf-8").split())
    assert command is not None and f"`{command.group(1)}`" in text

    def within_cap(heads: str, prior: str) -> str:
        row = re.search(rf"^\| {heads} \| {prior} \|(.*)$", table, re.M)
        assert row is not None, (heads, prior)
        return row.group(1).split("|")[4].strip().split("/")[0]  # certified ≤ N/2

    said = re.search(r"With the prior, (\d+) of 10 runs at 1,024 and (\d+) of 10 at 4,096 "
                     r"heads certify within the default cap, without one (\d+) of 10 and "
                     r"(\d+) of 10", text)
    assert said is not None
    assert said.groups() == (within_cap("1,024", "atp-path"), within_cap("4,096", "atp-path"),
                             within_cap("1,024", "none"), within_cap("4,096", "none"))
    assert {within_cap("270", prior) for prior in ("atp-path", "none")} == {"0"}


def test_method_page_says_what_recoverys_certified_runs_spent() -> None:
    """docs/method.md's account of where a certified run's measurements go is RECOVERY.md's
    `heads alone / sets` column (it said 24-36 sets and one per 6.1 heads on the held-out
    successor task, of an earlier render: the table says 38 sets there, one per 5.8)."""
    recovery = (ROOT / "RECOVERY.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\w+)(?: \(held out\))? \| 5/5 \|.*?\| (\d+ / \d+) \|",
                           recovery.split("## Certified by default", 1)[1], re.M))
    assert len(rows) == 6
    alone = {task: int(v.split(" / ")[0]) for task, v in rows.items()}
    sets = {task: int(v.split(" / ")[1]) for task, v in rows.items()}
    per_set = {task: (270 - alone[task]) / sets[task] for task in rows}
    text = " ".join((ROOT / "docs" / "method.md").read_text(encoding="utf-8").split())
    said = re.search(r"a median of (\d+)-(\d+) sets of two or more and (\d+)-(\d+) more heads "
                     r"alone .*? \(([\d.]+) on the held-out successor task, ([\d.]+) on "
                     r"kv_recall, ([\d.]+)-([\d.]+) on the other four\)", text)
    assert said is not None
    numbers = [float(value) for value in said.groups()]
    assert numbers[:4] == [min(sets.values()), max(sets.values()),
                           min(alone.values()) - 34, max(alone.values()) - 34]
    others = [v for task, v in per_set.items()
              if task not in ("heldout_successor", "heldout_kv_recall")]
    assert numbers[4:] == pytest.approx([per_set["heldout_successor"],
                                         per_set["heldout_kv_recall"], min(others),
                                         max(others)], abs=0.06)


def test_method_page_says_what_bench_generation_measured_on_the_cpu() -> None:
    """docs/method.md's figures for K masks per generate call on the CPU are BENCH.md's
    (it said 256 rows took 6-14 % less on the rhyme tasks, where the tables give 6-12 %,
    and 16 % more on swear, whose table has no 256-row call)."""
    bench = (ROOT / "BENCH.md").read_text(encoding="utf-8")

    def rows(task: str) -> dict[int, tuple[float, float, bool]]:
        section = bench.split(f"<!-- bench_generation SmolLM2-135M-Instruct {task}: start",
                              1)[1].split(": end -->", 1)[0]
        found = {}
        for label, per_call, seconds, speed_up in re.findall(
                r"^\| \d+( \(automatic\))?[^|]* \| (\d+) \| \d+ \| ([\d.]+) \| ([\d.]+)×",
                section, re.M):
            found[int(per_call)] = (float(seconds), float(speed_up), bool(label))
        return found

    tables = {task: rows(task) for task in ("rhyme", "swear", "rhyme_heldout")}
    automatic = [v[1] for table in tables.values() for v in table.values() if v[2]]
    less = [1 - tables[t][256][0] / tables[t][128][0] for t in ("rhyme", "rhyme_heldout")]
    assert 256 not in tables["swear"]
    text = " ".join((ROOT / "docs" / "method.md").read_text(encoding="utf-8").split())
    said = re.search(r"took ([\d.]+)-([\d.]+)× less time per mask than K = 1 on `rhyme`, "
                     r"`swear` and `rhyme_heldout`; 256 rows took (\d+)-(\d+) % less on the "
                     r"two rhyme tasks, BENCH", text)
    assert said is not None
    low, high, less_low, less_high = map(float, said.groups())
    assert (low, high) == (round(min(automatic), 1), round(max(automatic), 1))
    assert (less_low, less_high) == (round(100 * min(less)), round(100 * max(less)))


def test_package_docstring_examples_import_what_they_use() -> None:
    """A ``::`` example in the package's docstrings that imports is copied whole: every name
    it uses is imported or assigned in it (the commands package's used read_rankings
    without importing it: a NameError on its last line)."""
    import ast
    import builtins
    import textwrap

    problems = []
    for path in sorted((ROOT / "lm_eval_headloc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node) or ""
            for block in re.findall(r"::\n\n((?:(?: {4}.*)?\n)+)", doc + "\n"):
                code = textwrap.dedent(block)
                if not re.search(r"^(?:from|import) ", code, re.M):
                    continue  # a fragment, not an example to run
                tree = ast.parse(code)
                known = set(dir(builtins))
                for item in ast.walk(tree):
                    if isinstance(item, (ast.Import, ast.ImportFrom)):
                        known |= {a.asname or a.name.split(".")[0] for a in item.names}
                    elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                        known.add(item.id)
                used = {item.id for item in ast.walk(tree)
                        if isinstance(item, ast.Name) and isinstance(item.ctx, ast.Load)}
                if used - known:
                    problems.append(f"{path.relative_to(ROOT)}: {sorted(used - known)}")
    assert not problems, problems


def test_run_folder_docs_example_is_the_committed_default_run(committed_benchmarks) -> None:
    """The rest of docs/run-folder.md's example heads.json of "the default run" is that
    run's too (its largest_single_help was L7H3 +0.02; the run's is L11H3 +0.12): the
    scalars it shows, and the first names of the lists it abridges."""
    text = (ROOT / "docs" / "run-folder.md").read_text()
    example = text[text.index("```jsonc\n{"):text.index('  "certificate": {')]
    example += text[text.index('"prior_top_k"'):text.index('  "bootstrap": {')]
    run = committed_benchmarks / "recovery-runs" / "headloc_induction" / "certified" / "seed0"
    heads = json.loads((run / "heads.json").read_text())
    checked = 0
    for key, value in re.findall(r'^ *"(\w+)": (.+?),? *(?://.*)?$', example, re.M):
        if key not in heads or key in ("never_knocked_out", "prior_found_nothing"):
            continue  # only when given / only where the prior found nothing
        shown = json.loads(value.replace('"..."', "").replace(", ]", "]").rstrip(","))
        actual = heads[key]
        if isinstance(shown, list) and isinstance(actual, list):
            actual = actual[:len(shown)]
        if isinstance(shown, float):
            assert actual == pytest.approx(shown, abs=0.1), key
        else:
            assert actual == shown, key
        checked += 1
    assert checked >= 12
    # Its ranked entries: the first, measured alone, and an estimate (it showed rank 41 as
    # L12H0, -0.0088, a head the run ranks 116th at 0.0).
    entries = re.findall(r'\{"rank": (\d+), "head": "(\w+)".*?"effect": (-?[\d.]+)',
                         text[text.index('  "heads": ['):], re.S)
    assert len(entries) == 2
    by_rank = {entry["rank"]: entry for entry in heads["heads"]}
    for rank, head, effect in entries:
        assert by_rank[int(rank)]["head"] == head
        assert by_rank[int(rank)]["effect"] == pytest.approx(float(effect), abs=5e-4)
