"""benchmarks/simulate_certified.py: the measurements a certificate needs, simulated, and its
section of SIMULATION.md.

The table's numbers are recomputed here from runs of ``simulated_locate`` made by the test
(the world drawn from the seed as simulate_recovery.py's defaults draw it, the settings
written out by hand), so a row that counted the wrong runs, a wrong seed stream or a
wrong cap fails. The page tests check that each writer of SIMULATION.md keeps the other's
part byte for byte.
"""

from __future__ import annotations

import contextlib
import io
import re
import statistics

import numpy as np
import pytest
from helpers import assert_names, last_error

from headloc_bench import bench_sections, simulate_certified, simulate_recovery
from headloc_bench.defaults import simulated_prior
from headloc_bench.simulated_run import simulated_locate
from headloc_bench.simulation import planted_world, seed_trial
from lm_eval_headloc.runs.spec import RunSpec


@pytest.fixture(scope="module")
def certified():
    return simulate_certified


@pytest.fixture(scope="module")
def recovery():
    return simulate_recovery


def _by_hand(n_heads: int, prior: bool, seed: int, cap: int | str | None):
    """A run of seed ``seed`` made without the script: the world from the seed's first
    stream, the two-point prior from its fourth (headloc_bench.defaults.confirmed_masks_needed)."""
    streams = np.random.SeedSequence(seed).spawn(5)
    world = planted_world(n_heads, np.random.default_rng(streams[0]), noise="documents")
    if not prior:
        spec = RunSpec(bootstrap=1, progress=False, max_measurements=cap, prior="none")
        return simulated_locate(world, spec.budgeted(None))
    estimates = simulated_prior(world, np.random.default_rng(streams[3]), points=2)
    spec = RunSpec(bootstrap=1, progress=False, max_measurements=cap)
    return simulated_locate(world, spec.budgeted("atp-path"), prior=estimates)


def _page(recovery, rest: str = "") -> str:
    return f"{recovery.TITLE}\n\nGenerated earlier.\n\n| table |\n{rest}"


@pytest.fixture(scope="module")
def quick(certified, recovery, tmp_path_factory):
    """``--quick --out page``: its stdout and the page, which held another section."""
    page = tmp_path_factory.mktemp("quick") / "SIMULATION.md"
    before = _page(recovery, "\n<!-- other: start -->\n\nmine\n\n<!-- other: end -->\n")
    page.write_text(before, encoding="utf-8")
    out = io.StringIO()  # a module fixture: no capsys
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert certified.main(["--quick", "--out", str(page)]) == 0
    return out.getvalue(), page, before


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| 270 "):
            rows[cells[0], cells[1]] = cells[2:]
    return rows


def test_seed_s_is_simulate_recoverys_world_and_prior(certified):
    world, prior = certified.seed_world(270, 3)
    np.testing.assert_array_equal(world.effects, seed_trial(270, 0.1, 3, 1).world.effects)
    assert world.documents is not None  # fixed documents: a real run's example subset
    again = simulated_prior(world, np.random.default_rng(np.random.SeedSequence(3).spawn(5)[3]),
                            points=2)
    np.testing.assert_array_equal(prior, again)


def test_quick_rows_are_the_runs_recounted_by_hand(quick):
    """One row per (N, prior) for --quick (N = 270, seeds 0 and 1), each cell what the
    test's own runs give: certified and exact counts, spent median (min–max) and its share
    of N, certified within 135 (ceil(270/2)) and within 54, median helps / violations."""
    out, _, _ = quick
    rows = _rows(out)
    assert list(rows) == [("270", "atp-path"), ("270", "none")]
    for prior, label in ((True, "atp-path"), (False, "none")):
        runs = [_by_hand(270, prior, seed, 270) for seed in (0, 1)]
        for run in runs:
            assert run.certificate.measurements_spent == run.spent
        spent = [r.spent for r in runs]
        certified = [r for r in runs if r.certificate.certified]
        median = statistics.median(spent)
        assert rows["270", label][:7] == [
            f"{len(certified)}/2",
            f"{sum(r.exact(5) for r in runs)}/2",
            f"{median:g} ({min(spent)}–{max(spent)})",
            f"{100 * median / 270:.0f} %",
            f"{sum(r.spent <= 135 for r in certified)}/2",
            f"{sum(r.spent <= 54 for r in certified)}/2",
            f"{statistics.median(r.certificate.helps for r in runs):g} / "
            f"{statistics.median(r.certificate.violations for r in runs):g}",
        ], label
        # Seed 0's own spent count is one end of the row's range.
        assert str(spent[0]) in re.findall(r"\d+", rows["270", label][2])[1:]
    # The runs that did not certify are named with what they left.
    for line in out.splitlines():
        if line.startswith("- N = 270"):
            assert "unchecked" in line and "tied at the 5th place" in line


def test_certified_within_the_default_cap_is_what_a_default_run_ends_with(certified):
    """The table counts a run certified within the default cap (N/2) as a default run
    that certifies: the cap only ends the group tests. Seed 1 at 1,024 heads with the
    prior certifies at 146 measurements with the cap at N; with the default cap too, at
    the same count. At 270 heads it needs 232, more than 135: the default cap stops it."""
    assert certified.default_cap(1024) == 512 and certified.default_cap(270) == 135
    for n_heads in (1024, 270):
        raised = certified.seed_run(n_heads, "atp-path", 1)
        default = _by_hand(n_heads, True, 1, None)
        cap = certified.default_cap(n_heads)
        within = raised.certified and raised.spent <= cap
        assert within == (n_heads == 1024)  # the premise: one of each
        assert default.certificate.certified == within
        assert default.spent == (raised.spent if within else cap)


def test_the_section_is_written_into_the_page_leaving_the_rest(quick, certified):
    out, page, before = quick
    text = page.read_text(encoding="utf-8")
    assert text.startswith(before.rstrip("\n") + "\n\n<!-- certified: start -->\n\n")
    assert text.endswith("\n\n<!-- certified: end -->\n")
    body = text[len(before.rstrip("\n")):].split("-->", 1)[1].strip().splitlines()
    assert body[0].startswith("## ")
    assert re.match(r"Generated \d{4}-\d\d-\d\d \d\d:\d\d UTC in \d+ s on .*, by "
                    r"`python benchmarks/simulate_certified.py --quick --out .*SIMULATION\.md`",
                    body[2]), body[2]
    table_rows = [line for line in out.splitlines() if line.startswith("| 270 ")]
    assert all(row in body for row in table_rows) and len(table_rows) == 2
    assert "tail_mass=8.0" in text and "docs/method.md" in text
    # A second write replaces the section in place; everything else stays.
    certified.write_section(page, certified.SECTION, "## Again\n\nsecond",
                            certified.TITLE)
    again = page.read_text(encoding="utf-8")
    assert again == before.rstrip("\n") + (
        "\n\n<!-- certified: start -->\n\n## Again\n\nsecond\n\n<!-- certified: end -->\n")


def test_out_must_be_the_simulation_page_and_is_checked_before_any_work(
        certified, recovery, tmp_path, capsys):
    theirs = tmp_path / "notes.md"
    theirs.write_text("# My notes\n", encoding="utf-8")
    empty = tmp_path / "empty.md"
    empty.write_text("", encoding="utf-8")
    for target, names in ((theirs, [str(theirs), repr(recovery.TITLE)]),
                          (tmp_path / "missing.md", [str(tmp_path / "missing.md"),
                                                     "simulate_recovery.py --out"]),
                          (empty, [str(empty), "simulate_recovery.py --out"])):
        with pytest.raises(SystemExit) as stopped:
            certified.main(["--quick", "--out", str(target)])
        assert stopped.value.code == 2
        assert_names(last_error(capsys), *names)
    assert theirs.read_text(encoding="utf-8") == "# My notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.md", "notes.md"]


def test_simulate_recovery_keeps_the_pages_sections(recovery, tmp_path):
    """Its --out rewrites its own part and appends the page's sections byte for byte; a
    page with none is written as before (its part, one newline at the end)."""
    section = "<!-- certified: start -->\n\n## Certified\n\n| a |  b |\n\n<!-- certified: end -->"
    page, bare = tmp_path / "SIMULATION.md", tmp_path / "bare.md"
    page.write_text(_page(recovery, f"\nold rows\n\n{section}\n"), encoding="utf-8")
    argv = ["--n-heads", "40", "--sparsities", "0.1", "--seeds", "2", "--budgets", "8,16",
            "--fixed-budgets", "8", "--no-sensitivity", "--no-defaults"]
    assert recovery.main([*argv, "--out", str(page)]) == 0
    assert recovery.main([*argv, "--out", str(bare)]) == 0
    text, own = page.read_text(encoding="utf-8"), bare.read_text(encoding="utf-8")
    assert "old rows" not in text and text.startswith(recovery.TITLE)
    assert text.endswith("\n\n" + section + "\n")
    assert not own.endswith("\n\n") and "<!--" not in own
    # Its own part is what it writes into a page without sections (but the time stamp).
    stamp = re.compile(r"Generated .* by")
    assert stamp.sub("", text[:-len(section) - 3]) == stamp.sub(
        "", own.rstrip("\n").replace(str(bare), str(page)))


def test_write_section_keeps_bench_pages_beginning_by_default(certified, recovery, tmp_path):
    """``begins`` names another page's beginning; without it BENCH.md's still applies, and
    a page that must begin with its title is not begun by a section."""
    sections = bench_sections
    page = tmp_path / "SIMULATION.md"
    page.write_text(_page(recovery), encoding="utf-8")
    with pytest.raises(FileExistsError):
        sections.write_section(page, "certified", "rows")  # not a BENCH.md
    sections.write_section(page, "certified", "rows", recovery.TITLE)
    assert page.read_text(encoding="utf-8").startswith(_page(recovery).rstrip("\n"))
    with pytest.raises(ValueError):
        sections.write_section(tmp_path / "new.md", "certified", "rows", recovery.TITLE)
    assert not (tmp_path / "new.md").exists()
