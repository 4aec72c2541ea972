"""``headloc-harness overlap``: CNL's stability check between two runs' top-k. Every
expected number here is worked out by hand from hand-chosen sets (or, for tie-breaks, by
enumerating every way of breaking the ties), not by the code under test."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from helpers import TAMPERED_RANKINGS, TASKS, assert_names, error_line, harness, tamper

from lm_eval_headloc.commands.overlap import MADE_BY, overlap, overlap_markdown
from lm_eval_headloc.runs.spec import RunSpec


def write_run(folder: Path, rankings: dict[str, list[str]], *, model_args: str = "m",
              top_k: int = 5, seed: int = 0, subset: dict[str, list[int]] | None = None,
              tied: dict[str, set[str]] | None = None,
              effects: dict[str, list[float]] | None = None,
              include_path: tuple[str, ...] = (),
              largest_help: dict[str, dict] | None = None, components: str = "heads",
              candidates: list[str] | None = None, used: dict[str, int] | None = None,
              **options: object) -> Path:
    """A finished-looking run folder: config.json and one heads-<task>.json per task, as
    locate writes them (``tied_with_above`` both as the list and per entry; higher is
    better: a negative effect hurts); ``candidates``: a neuron run's candidate neurons;
    ``used``: its examples_used; ``options``: other RunSpec fields."""
    folder.mkdir(parents=True)
    spec = RunSpec(model_args=model_args, tasks=tuple(rankings), top_k=top_k, seed=seed,
                   include_path=include_path, components=components, **options)
    config = {"command": "locate", "identity": spec.identity("locate"),
              "settings": spec.settings("locate"), "spec": spec.as_config()}
    if subset is not None:
        config["example_subset"] = subset
    if candidates is not None:
        config["candidates"] = candidates
    if used is not None:
        config["examples_used"] = used
    (folder / "config.json").write_text(json.dumps(config))
    for task, names in rankings.items():
        ties = (tied or {}).get(task, set())
        values = (effects or {}).get(task) or [-1.0 / (i + 1) for i in range(len(names))]
        helps = {"largest_single_help": largest_help[task]} if task in (largest_help or {}) else {}
        (folder / f"heads-{task}.json").write_text(json.dumps({
            "task": task, "higher_is_better": True, "top_k": names[:top_k],
            "tied_with_above": sorted(ties), **helps,
            "heads": [{"rank": r, "head": n, "effect": e, "tied_with_above": n in ties}
                      for r, (n, e) in enumerate(zip(names, values, strict=True), start=1)]}))
    return folder


# --- the numbers -------------------------------------------------------------------------

def test_overlap_rate_iou_and_curve_by_hand(tmp_path, capsys):
    # top-3: A = {L0H1, L2H0, L1H1}, B = {L2H0, L3H3, L0H1}: 2 shared, union 4.
    a = write_run(tmp_path / "a", {"t": ["L0H1", "L2H0", "L1H1", "L3H3", "L0H0"]},
                  subset={"t": [0, 1, 2]}, seed=0)
    b = write_run(tmp_path / "b", {"t": ["L2H0", "L3H3", "L0H1", "L1H2", "L0H0"]},
                  subset={"t": [3, 4, 5]}, seed=1)
    out = tmp_path / "cmp" / "overlap.json"
    assert harness("overlap", str(a), str(b), "--top-k", "3", "--out", str(out)) == 0
    result = json.loads(out.read_text())
    entry = result["tasks"]["t"]
    assert entry["a"]["top_k"] == ["L0H1", "L2H0", "L1H1"]
    assert entry["b"]["top_k"] == ["L2H0", "L3H3", "L0H1"]
    assert entry["shared"] == ["L0H1", "L2H0"]
    assert entry["overlap_rate_a"] == entry["overlap_rate_b"] == pytest.approx(2 / 3)
    assert entry["iou"] == pytest.approx(2 / 4)
    assert entry["well_defined"] and entry["shared_range"] == [2, 2]
    # k = 1: {L0H1} vs {L2H0}: 0; k = 2: {L0H1, L2H0} vs {L2H0, L3H3}: 1 (union 3).
    assert [p["shared"] for p in entry["curve"]] == [0, 1, 2]
    assert [p["share"] for p in entry["curve"]] == pytest.approx([0, 1 / 2, 2 / 3])
    assert [p["iou"] for p in entry["curve"]] == pytest.approx([0, 1 / 3, 2 / 4])
    assert result["examples"]["status"] == "disjoint" and result["examples"]["shared"] == 0
    assert result["differs_in"] == ["seed"]
    assert result["made_by"] == MADE_BY
    table = out.with_suffix(".md").read_text()
    printed = capsys.readouterr().out
    assert overlap_markdown(result) in table and overlap_markdown(result) in printed
    assert "| A | L0H1, L2H0, L1H1 | 66.7% |" in table
    assert "Shared (2): L0H1, L2H0; IoU 50.0%." in table and "disjoint" in table
    assert "| 2 | 1 | 50.0% | 33.3% |  |" in table
    # Rerunning overwrites the files it wrote.
    assert harness("overlap", str(a), str(b), "--top-k", "2", "--out", str(out)) == 0
    assert json.loads(out.read_text())["tasks"]["t"]["a"]["k"] == 2


def test_neuron_names_and_each_runs_own_top_k(tmp_path):
    """Names are opaque strings: neurons (and heads among them) compare as they are. With
    no --top-k each run keeps its own, so the two overlap rates differ."""
    a = write_run(tmp_path / "a", {"t": ["L3N12", "L0N5", "L7N1", "L1H2"]}, top_k=2,
                  subset={"t": [0, 1, 2, 3]})
    b = write_run(tmp_path / "b", {"t": ["L0N5", "L7N1", "L3N12", "L1N9", "L1H2"]},
                  top_k=4, subset={"t": [2, 3, 4]})
    result = overlap(a, b)  # the Python API writes nothing without out=
    entry = result["tasks"]["t"]
    # A = {L3N12, L0N5}, B = {L0N5, L7N1, L3N12, L1N9}: 2 shared, union 4.
    assert (entry["a"]["k"], entry["b"]["k"]) == (2, 4)
    assert sorted(entry["shared"]) == ["L0N5", "L3N12"]
    assert entry["overlap_rate_a"] == pytest.approx(1.0)
    assert entry["overlap_rate_b"] == pytest.approx(0.5)
    assert entry["iou"] == pytest.approx(0.5)
    # The curve runs to the larger k: top-1..4 of both (A's ranking goes on past its k).
    # k=1: L3N12 vs L0N5; k=2: {L3N12,L0N5} vs {L0N5,L7N1}; k=3: all three; k=4: 3 of 4.
    assert [p["shared"] for p in entry["curve"]] == [0, 1, 3, 3]
    # Examples 2 and 3 are in both subsets.
    assert result["examples"]["status"] == "overlapping"
    assert result["examples"]["tasks"]["t"] == {"a": 4, "b": 3, "shared": 2}
    assert "**overlapping**: 2 examples shared" in overlap_markdown(result)
    assert not list(tmp_path.glob("*.json"))


def test_neurons_the_other_run_never_searched_are_said(tmp_path):
    """A neuron run searches only its candidates (its prior's picks on its own examples):
    A's top-3 holds L0N2 and L0N3, never candidates of B, and B's holds L1N7, never one of
    A's. The overlap of 1 in 3 said nothing of it, so it read as unstable localization."""
    a = write_run(tmp_path / "a", {"t": ["L0N1", "L0N2", "L0N3", "L1N5"]}, top_k=3,
                  components="neurons", candidates=["L0N1", "L0N2", "L0N3", "L1N5"])
    b = write_run(tmp_path / "b", {"t": ["L0N1", "L1N7", "L1N5", "L1N6"]}, top_k=3,
                  components="neurons", candidates=["L0N1", "L1N5", "L1N6", "L1N7"])
    result = overlap(a, b)
    entry = result["tasks"]["t"]
    assert entry["shared"] == ["L0N1"]  # the overlap itself is unchanged
    assert entry["a"]["not_searched_by_other"] == ["L0N2", "L0N3"]
    assert entry["b"]["not_searched_by_other"] == ["L1N7"]
    assert result["runs"]["a"]["candidate_neurons"] == result["runs"]["b"]["candidate_neurons"] == 4
    table = overlap_markdown(result)
    assert ("2 of A's top-3 (L0N2, L0N3) were never searched by B: not among B's 4 candidate "
            "neurons") in table
    assert "1 of B's top-3 (L1N7) was never searched by A" in table
    assert "that part of the gap is which candidates each run's prior picked" in table
    # A run that records no candidates (an older folder): unknown, said so.
    old = write_run(tmp_path / "old", {"t": ["L0N1", "L1N7", "L1N5"]}, top_k=3,
                    components="neurons")
    result = overlap(a, old)
    assert result["tasks"]["t"]["a"]["not_searched_by_other"] is None
    assert "B records no candidate neurons" in overlap_markdown(result)
    # Heads runs search every head: nothing to say.
    heads = [write_run(tmp_path / name, {"t": ["L0H1", "L0H2", "L1H0"]}, top_k=2)
             for name in ("h1", "h2")]
    result = overlap(*heads)
    assert result["tasks"]["t"]["a"]["not_searched_by_other"] == []
    assert result["runs"]["a"]["candidate_neurons"] is None
    assert "never searched" not in overlap_markdown(result)


def test_tasks_are_compared_where_both_runs_rank_them(tmp_path):
    a = write_run(tmp_path / "a", {"x": ["L0H0", "L0H1"], "y": ["L1H0", "L1H1"]}, top_k=1)
    b = write_run(tmp_path / "b", {"y": ["L1H0", "L0H0"], "z": ["L0H0", "L1H1"]}, top_k=1)
    result = overlap(a, b)
    assert list(result["tasks"]) == ["y"]
    assert result["only_in_a"] == ["x"] and result["only_in_b"] == ["z"]
    assert result["tasks"]["y"]["iou"] == 1.0
    # Neither recorded its example subset: whether they are disjoint is unknown.
    assert result["examples"]["status"] == "unknown"
    assert "recorded no example subset" in result["examples"]["why"]


def test_differs_in_holds_the_ranking_settings_and_the_header_the_examples_used(tmp_path):
    """differs_in compared the identity alone, which leaves out what refit may change: a run
    and a refit of it with --exclude L1H* differed in nothing. And the header said '10
    examples per task' where each run used 6 (--num-samples 10 --examples-part 1/2 of a
    12-document task)."""
    halves = dict(num_samples=10, used={"t": 6})
    a = write_run(tmp_path / "a", {"t": ["L1H0", "L0H0", "L0H1"]}, examples_part="1/2",
                  subset={"t": [0, 1, 2, 3, 4, 5]}, **halves)
    refit = write_run(tmp_path / "refit", {"t": ["L0H0", "L0H1"]}, examples_part="1/2",
                      subset={"t": [0, 1, 2, 3, 4, 5]}, exclude="L1H*", **halves)
    assert overlap(a, refit, top_k=2)["differs_in"] == ["exclude"]
    b = write_run(tmp_path / "b", {"t": ["L0H0", "L1H0", "L0H1"]}, examples_part="2/2",
                  subset={"t": [6, 7, 8, 9, 10, 11]}, alpha=0.05, top_k=3, **halves)
    result = overlap(a, b, top_k=2)
    assert result["differs_in"] == ["alpha", "examples_part", "top_k"]
    assert result["runs"]["a"]["examples_used"] == {"t": 6}
    table = overlap_markdown(result)
    assert "10 examples per task" not in table
    assert (f"- A: `{a.resolve()}`: seed 0, top-2; examples used: t 6 (--num-samples 10, "
            "--examples-part 1/2)") in table
    assert "- The runs' settings differ in: alpha, examples_part, top_k." in table
    # A folder from before examples_used was recorded: what it asked, said as such.
    old = write_run(tmp_path / "old", {"t": ["L0H0", "L1H0"]}, num_samples=10)
    assert ("10 examples per task asked (--num-samples 10; used: not recorded)"
            in overlap_markdown(overlap(a, old, top_k=2)))


def test_subsets_of_tasks_from_different_folders_are_unknown(tmp_path):
    a = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1"]}, subset={"t": [0, 1]},
                  include_path=(str(tmp_path / "one"),))
    b = write_run(tmp_path / "b", {"t": ["L0H0", "L0H1"]}, subset={"t": [2, 3]},
                  include_path=(str(tmp_path / "two"),))
    examples = overlap(a, b, top_k=1)["examples"]
    assert examples["status"] == "unknown" and "--include-path" in examples["why"]


# --- ties and rankings that found nothing ------------------------------------------------

def test_a_tie_at_the_boundary_is_said_not_ordered(tmp_path):
    # A: L0H0, then L0H1 = L0H2 = L0H3 (one tie group): its top-2 is L0H0 and any one of
    # the three. B: L0H0, L0H3 (no ties). Shared: L0H0, plus L0H3 if A's pick is L0H3.
    a = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"]},
                  tied={"t": {"L0H2", "L0H3"}})
    b = write_run(tmp_path / "b", {"t": ["L0H0", "L0H3", "L1H0", "L0H1", "L0H2"]})
    out = tmp_path / "o.json"
    result = overlap(a, b, top_k=2, out=out)
    entry = result["tasks"]["t"]
    assert entry["a"]["tie"] == {"group": ["L0H1", "L0H2", "L0H3"], "places": 1}
    assert entry["b"]["tie"] is None
    assert not entry["well_defined"] and entry["shared_range"] == [1, 2]
    assert entry["shared"] == ["L0H0"]  # in the files' order, said as such below
    # The curve: at k=1 nobody is tied; at k=2 A's boundary is inside the group.
    assert [p["tied"] for p in entry["curve"]] == [[], ["a"]]
    assert [p["shared_range"] for p in entry["curve"]] == [[1, 1], [1, 2]]
    # Top-3: A holds two of the three; B's L0H0, L0H3, L1H0 shares L0H0 and maybe L0H3.
    assert overlap(a, b, top_k=3)["tasks"]["t"]["shared_range"] == [1, 2]
    # Top-4 takes the whole group: defined again. B's top-4 is L0H0 L0H3 L1H0 L0H1: 3 of
    # A's 4 shared, union 5.
    entry4 = overlap(a, b, top_k=4)["tasks"]["t"]
    assert entry4["well_defined"] and entry4["a"]["tie"] is None
    assert entry4["iou"] == pytest.approx(3 / 5)
    table = out.with_suffix(".md").read_text()
    assert "A's top-2 is not well defined: its ranks 2 and 3 have the same evidence" in table
    assert "Shared 1–2 depending on how the ties are broken (1 in the files' order: L0H0)" \
        in table
    # Every figure of a tied row is the range: 1 or 2 shared of 2, IoU 1/3 or 1.
    assert "| A | L0H0, L0H1 | 50.0%–100.0% |" in table
    assert "| 2 | 1–2 | 50.0%–100.0% | 33.3%–100.0% | A tied at k (files' order: 1) |" in table


def test_both_boundaries_tied(tmp_path):
    # A's top-2: L0H0 + one of {L0H1, L0H2, L0H3}; B's top-2: L0H0 + one of {L0H3, L1H0}.
    # Both pick L0H3: 2 shared; otherwise 1.
    a = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"]},
                  tied={"t": {"L0H2", "L0H3"}})
    b = write_run(tmp_path / "b", {"t": ["L0H0", "L0H3", "L1H0", "L0H1"]},
                  tied={"t": {"L1H0"}})
    entry = overlap(a, b, top_k=2)["tasks"]["t"]
    assert entry["b"]["tie"] == {"group": ["L0H3", "L1H0"], "places": 1}
    assert entry["shared_range"] == [1, 2]
    assert entry["curve"][1]["tied"] == ["a", "b"]


def _brute_force_range(names, ties, other_names, other_ties, k):
    """Fewest and most shared over every tie-break of both top-k: each tie group is
    reordered every way it can be, and the top-k of each order compared."""
    def orders(ranking, tied):
        groups: list[list[str]] = []
        for name in ranking:
            if name in tied and groups:
                groups[-1].append(name)
            else:
                groups.append([name])
        for choice in itertools.product(*(itertools.permutations(g) for g in groups)):
            yield set([n for g in choice for n in g][:k])

    counts = [len(x & y) for x in orders(names, ties) for y in orders(other_names, other_ties)]
    return [min(counts), max(counts)]


@pytest.mark.parametrize("seed", range(12))
def test_the_tie_break_range_is_every_way_of_breaking_the_ties(tmp_path, seed):
    rng = random.Random(seed)
    pool = [f"L{i}N{j}" for i in range(2) for j in range(4)]
    rankings, tieds = [], []
    for _ in range(2):
        names = rng.sample(pool, 7)
        rankings.append(names)
        tieds.append({n for n in names[1:] if rng.random() < 0.5})
    k = rng.randint(1, 6)
    a = write_run(tmp_path / "a", {"t": rankings[0]}, tied={"t": tieds[0]})
    b = write_run(tmp_path / "b", {"t": rankings[1]}, tied={"t": tieds[1]})
    entry = overlap(a, b, top_k=k)["tasks"]["t"]
    assert entry["shared_range"] == _brute_force_range(rankings[0], tieds[0], rankings[1],
                                                       tieds[1], k)
    for point in entry["curve"]:
        assert point["shared_range"] == _brute_force_range(
            rankings[0], tieds[0], rankings[1], tieds[1], point["k"])


def test_a_ranking_that_found_nothing_is_said(tmp_path):
    # A: everything after the first tied with the one above (cli's "no head stands out");
    # B: every effect 0.
    a = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                  tied={"t": {"L0H1", "L0H2", "L0H3"}})
    b = write_run(tmp_path / "b", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                  effects={"t": [0.0, 0.0, 0.0, 0.0]})
    result = overlap(a, b, top_k=3)
    entry = result["tasks"]["t"]
    assert entry["a"]["nothing_found"].startswith("no component stands out")
    assert entry["b"]["nothing_found"].startswith("no effect found")
    table = overlap_markdown(result)
    assert "A found nothing: no component stands out" in table
    assert "B found nothing: no effect found" in table
    # A ranking with effects and no ties found something.
    c = write_run(tmp_path / "c", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]})
    assert overlap(a, c, top_k=3)["tasks"]["t"]["b"]["nothing_found"] is None
    # One whose top-k all do no harm (a task at chance: the rest of it helps) found
    # nothing either, though some effect in it is not 0 (this was not said).
    d = write_run(tmp_path / "d", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                  effects={"t": [0.0, 0.0, 0.0, 0.02]})
    assert overlap(c, d, top_k=3)["tasks"]["t"]["b"]["nothing_found"] == (
        "none of its top 3 hurts the task (each is recorded to do no harm)")
    # Said after "found nothing", without saying it twice.
    table = overlap_markdown(overlap(c, d, top_k=3))
    assert "B found nothing: none of its top 3 hurts the task" in table
    assert "nothing found" not in table



def test_top_k_places_filled_by_harmless_components_are_said(tmp_path):
    # A found two that hurt; its top-3's third (L0H2) changed nothing (a place filled).
    a = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                  effects={"t": [-0.3, -0.1, 0.0, 0.0]})
    b = write_run(tmp_path / "b", {"t": ["L0H1", "L0H0", "L0H2", "L0H3"]})
    entry = overlap(a, b, top_k=3)["tasks"]["t"]
    assert entry["a"]["harmless"] == ["L0H2"] and entry["b"]["harmless"] == []
    table = overlap_markdown(overlap(a, b, top_k=3))
    assert ("A's top-3 holds 1 that its ranking records as doing no harm (L0H2): a place "
            "filled because fewer hurt, not a find; it counts above as listed.") in table
    assert "B's top-3 holds" not in table
    # Two: the plural.
    two = write_run(tmp_path / "two", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                    effects={"t": [-0.3, 0.0, 0.0, 0.0]})
    assert ("A's top-3 holds 2 that its ranking records as doing no harm (L0H1, L0H2): "
            "places filled because fewer hurt, not finds; they count above as listed."
            ) in overlap_markdown(overlap(two, b, top_k=3))
    # Iterative greedy's order: a harmless round winner above one that hurts fills no
    # place "because fewer hurt" (it was said so).
    order = write_run(tmp_path / "order", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                      effects={"t": [-0.3, 0.0, -0.1, 0.0]})
    entry = overlap(order, b, top_k=3)["tasks"]["t"]["a"]
    assert entry["harmless"] == [] and entry["harmless_above_hurting"] == {"L0H1": ["L0H2"]}
    table = overlap_markdown(overlap(order, b, top_k=3))
    assert ("A's top-3 ranks L0H1 above L0H2, though its ranking records it as doing no "
            "harm and the ones below as hurting: a place in the run's order") in table
    assert "because fewer hurt" not in table
    # Nothing hurts: nothing is ranked above one that hurts (top[:-1] listed L0H0, L0H1).
    none = write_run(tmp_path / "none", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                     effects={"t": [0.0, 0.0, 0.0, 0.0]})
    assert overlap(none, b, top_k=3)["tasks"]["t"]["a"]["harmless_above_hurting"] == {}

def test_top_k_harms_within_the_spread_of_single_knockouts_are_said(tmp_path):
    # A's L0H1 and L0H2 lose less than L0H3's knockout gains (+0.03): noise, not finds;
    # L0H0 (-0.3) is beyond it, and L0H3 itself does no harm.
    a = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                  effects={"t": [-0.3, -0.02, -0.01, 0.03]},
                  largest_help={"t": {"head": "L0H3", "change": 0.03}})
    b = write_run(tmp_path / "b", {"t": ["L0H1", "L0H0", "L0H2", "L0H3"]})
    entry = overlap(a, b, top_k=3)["tasks"]["t"]
    assert entry["a"]["within_spread"] == ["L0H1", "L0H2"] and entry["b"]["within_spread"] == []
    table = overlap_markdown(overlap(a, b, top_k=3))
    assert ("A's top-3 holds 2 that hurt the task by no more than a single knockout helps it "
            "in that run (L0H1, L0H2): within the spread of single knockouts, no evidence the "
            "task needs them; they count above as listed.") in table
    assert "B's top-3 holds 2" not in table
    # A loss equal to the help up to round-off is within it too; one beyond it is not.
    c = write_run(tmp_path / "c", {"t": ["L0H0", "L0H1", "L0H2", "L0H3"]},
                  effects={"t": [-0.3, (13 / 24 - 14 / 24), -0.05, 1 / 24]},
                  largest_help={"t": {"head": "L0H3", "change": 15 / 24 - 14 / 24}})
    assert overlap(c, b, top_k=3)["tasks"]["t"]["a"]["within_spread"] == ["L0H1"]
    assert ("A's top-3 holds 1 that hurts the task by no more than a single knockout helps "
            "it in that run (L0H1): within the spread of single knockouts, no evidence the "
            "task needs it; it counts above as listed.") in overlap_markdown(overlap(c, b, top_k=3))


def test_verify_and_cross_notes_carry_what_the_ranking_says_of_its_top_k(tmp_path):
    from lm_eval_headloc.commands.verify import ranking_notes
    from lm_eval_headloc.runs.folder import RunFolder

    run = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"],
                                     "u": ["L0H0", "L0H1", "L0H2"]},
                    effects={"t": [-0.3, -0.02, 0.0, -0.01, -0.01], "u": [0.0, 0.0, 0.0]},
                    tied={"t": {"L1H0"}, "u": {"L0H1", "L0H2"}},
                    largest_help={"t": {"head": "L1H1", "change": 0.03}})
    assert ranking_notes(RunFolder(run), "t", 2) == [
        "L0H1: hurt the task by no more than a single knockout helps it (within the spread of "
        "single knockouts)"]
    assert ranking_notes(RunFolder(run), "t", 4) == [
        "L0H3, L1H0 have the same evidence across the top-4's last place: it holds 1 of them "
        "by index, not by evidence",
        # L0H2 is ranked above L0H3, which hurts: not a place filled because fewer hurt.
        "L0H2: recorded to do no harm, yet ranked above L0H3, which hurts the task: listed "
        "for its place in that order, not because fewer hurt",
        "L0H1, L0H3: hurt the task by no more than a single knockout helps it (within the "
        "spread of single knockouts)"]
    assert ranking_notes(RunFolder(run), "u", 3) == [
        "the run found nothing: no component stands out (the top 3 all have the same "
        "evidence, so their order is the index)"]


# --- refusals: one line, exit status 2 ----------------------------------------------------

def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    a = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1", "L0H2"]})
    b = write_run(tmp_path / "b", {"t": ["L0H1", "L0H0", "L0H2"]})
    other_model = write_run(tmp_path / "c", {"t": ["L0H0"]}, model_args="another")
    other_task = write_run(tmp_path / "d", {"u": ["L0H0"]})
    unfinished = tmp_path / "e"
    write_run(unfinished, {"t": ["L0H0"]})
    (unfinished / "heads-t.json").unlink()
    out = ["--out", str(tmp_path / "o.json")]
    cases = [  # the values each refusal names
        ([str(tmp_path / "nowhere"), str(a)], (str(tmp_path / "nowhere"), "config.json")),
        ([str(a), str(a / ".." / "a")], ("RUN_A", "RUN_B")),
        ([str(a), str(b), "--top-k", "0"], ("--top-k 0", ">= 1")),
        ([str(a), str(b), "--top-k", "4"], ("--top-k 4", "heads-t.json", "3")),
        ([str(a), str(other_model)], ("'m'", "'another'")),
        ([str(a), str(other_task)], (str(a), str(other_task))),
        ([str(a), str(unfinished)], (str(unfinished), "heads-<task>.json")),
    ]
    for args, values in cases:
        assert harness("overlap", *args, *out) == 2, args
        assert_names(error_line(capsys), *values)
    assert not (tmp_path / "o.json").exists()
    # With no --top-k each run's own is checked the same way (and said to be the run's).
    big = write_run(tmp_path / "f", {"t": ["L0H0", "L0H1"]}, top_k=5)
    assert harness("overlap", str(a), str(big), "--out", str(tmp_path / "o.json")) == 2
    assert_names(error_line(capsys), "--top-k 5", "the run's own", "heads-t.json")
    # The values are named: both models, both task lists.
    harness("overlap", str(a), str(other_model), *out)
    assert "'m'" in (line := error_line(capsys)) and "'another'" in line
    harness("overlap", str(a), str(other_task), *out)
    assert ": t;" in (line := error_line(capsys)) and ": u)" in line


@pytest.mark.parametrize("how", list(TAMPERED_RANKINGS))
def test_a_tampered_ranking_file_is_one_line_and_exit_2(tmp_path, capsys, how):
    """Each altered ranking file (``TAMPERED_RANKINGS``) is refused in one line naming the
    file and the field, for either run, and nothing is written: never a traceback, never an
    overlap counted from it."""
    names = ["L0H0", "L0H1", "L0H2", "L0H3", "L0H4", "L1H0"]
    a = write_run(tmp_path / "a", {"t": names})
    b = write_run(tmp_path / "b", {"t": [*names[:4], "L1H1", "L1H2"]})
    # Untouched, 4 of the top-5 are shared (L0H0-L0H3): 0.8. A's 5th renamed L0H0 made it
    # 1.0 (every name of A's top-5 is in B's).
    assert overlap(a, b, top_k=5)["tasks"]["t"]["overlap_rate_a"] == pytest.approx(0.8)
    tamper(a / "heads-t.json", how)
    out = tmp_path / "o.json"
    capsys.readouterr()
    for runs in ((a, b), (b, a)):
        assert harness("overlap", *map(str, runs), "--top-k", "5", "--out", str(out)) == 2
        assert_names(error_line(capsys), str(a), "heads-t.json", *TAMPERED_RANKINGS[how][1])
    assert not out.exists() and not out.with_suffix(".md").exists()


def test_out_never_overwrites_a_file_that_is_not_ours(tmp_path, capsys):
    a = write_run(tmp_path / "a", {"t": ["L0H0", "L0H1"]})
    b = write_run(tmp_path / "b", {"t": ["L0H1", "L0H0"]})
    foreign_json = tmp_path / "notes.json"
    foreign_json.write_text('{"mine": true}')
    foreign_md = tmp_path / "mine.md"
    foreign_md.write_text("# my notes\n")
    (tmp_path / "mine.json").write_text(json.dumps({"made_by": MADE_BY}))  # ours; its .md not
    cases = [  # the file refused and, where it is the wrong kind, the kind to name
        (foreign_json, (str(foreign_json),)),
        (tmp_path / "mine.json", (str(foreign_md),)),
        (tmp_path / "table.md", (str(tmp_path / "table.md"), ".json")),
        (tmp_path, (str(tmp_path), ".json")),
        (a / "overlap.json", (str(a / "overlap.json"), str(a))),  # and the run it reads
    ]
    for target, values in cases:
        assert harness("overlap", str(a), str(b), "--top-k", "1", "--out", str(target)) == 2
        assert_names(error_line(capsys), *values)
    assert foreign_json.read_text() == '{"mine": true}'
    assert foreign_md.read_text() == "# my notes\n"
    assert not (a / "overlap.json").exists() and not (tmp_path / "table.md").exists()
    folder = tmp_path / "x.json"
    folder.mkdir()
    assert harness("overlap", str(a), str(b), "--out", str(folder)) == 2
    assert_names(error_line(capsys), str(folder))


# --- on real runs ---------------------------------------------------------------------------

def test_two_locate_runs_with_other_seeds(tiny_model_dir, tmp_path, capsys):
    """--seed draws each run's example subset (and, unless --design-seed, its masks): two
    seeds give other subsets of the task, which overlap by chance. The command reads what
    locate wrote: its rankings, ties and subsets."""
    base = ["locate", "--model-args", f"pretrained={tiny_model_dir('llama')},dtype=float32",
            "--include-path", TASKS, "--tasks", "tiny_copy", "--masks", "6",
            "--sparsity", "0.25", "--num-samples", "4", "--top-k", "3", "--prior", "none",
            "--confirm", "0", "--bootstrap", "10", "--design-seed", "0"]
    for seed in ("1", "2"):
        assert harness(*base, "--seed", seed, "--out", str(tmp_path / seed)) == 0
    out = tmp_path / "overlap.json"
    assert harness("overlap", str(tmp_path / "1"), str(tmp_path / "2"), "--out",
                   str(out)) == 0
    result = json.loads(out.read_text())
    configs = [json.loads((tmp_path / s / "config.json").read_text()) for s in "12"]
    subsets = [set(c["example_subset"]["tiny_copy"]) for c in configs]
    assert configs[0]["example_subset"] != configs[1]["example_subset"]
    examples = result["examples"]
    assert examples["shared"] == len(subsets[0] & subsets[1])
    assert examples["status"] == ("overlapping" if subsets[0] & subsets[1] else "disjoint")
    heads = [json.loads((tmp_path / s / "heads-tiny_copy.json").read_text()) for s in "12"]
    entry = result["tasks"]["tiny_copy"]
    assert entry["a"]["top_k"] == [h["head"] for h in heads[0]["heads"][:3]]
    assert entry["b"]["top_k"] == [h["head"] for h in heads[1]["heads"][:3]]
    shared = set(entry["a"]["top_k"]) & set(entry["b"]["top_k"])
    assert entry["overlap_rate_a"] == pytest.approx(len(shared) / 3)
    assert result["differs_in"] == ["seed"]
    assert "Written to" in capsys.readouterr().out


def test_a_certificates_tie_at_the_kth_place_leaves_the_top_k_undefined(tmp_path):
    """Two runs whose certificates list every head as tied within the noise at the k-th
    place were compared as well-defined top-k sets: only equal evidence counted as a tie.
    At the run's own top-k a noise tie is one too; at another k it says nothing."""
    names = ["L0H0", "L0H1", "L0H2", "L0H3"]
    a = write_run(tmp_path / "a", {"t": names}, top_k=2)
    path = a / "heads-t.json"
    data = json.loads(path.read_text())
    data["certificate"] = {"top_k": 2, "tied_at_k": ["L0H1", "L0H2"]}
    path.write_text(json.dumps(data))
    b = write_run(tmp_path / "b", {"t": ["L0H0", "L0H2", "L0H1", "L0H3"]}, top_k=2)
    entry = overlap(a, b)["tasks"]["t"]
    assert entry["a"]["tie"] == {"group": ["L0H1", "L0H2"], "places": 1}
    assert entry["well_defined"] is False  # 1 or 2 shared, as the tie is broken
    assert "measured harms within the noise" in overlap_markdown(overlap(a, b))
    assert overlap(a, b, top_k=3)["tasks"]["t"]["a"]["tie"] is None
