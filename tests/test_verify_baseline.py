"""verify's CNL checks: the top-k against random sets of as many heads, and enhance
(--scale 2) next to erase (scale 0), on a tiny random Llama (2 layers x 4 heads)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import HEADS, LAYERS, TASKS, finished_run, harness, raises_naming
from helpers import measurement_lines as lines

from lm_eval_headloc.commands.verify import random_like, random_sets
from lm_eval_headloc.intervention.components import parse_heads
from lm_eval_headloc.intervention.geometry import Geometry
from lm_eval_headloc.method.ranking import relative_drop

GEOMETRY = Geometry(LAYERS, HEADS, None)
LOCATED = ("L1H2", "L0H0", "L0H3", "L1H0")  # the fake run's ranking, best first


# --- the draw itself ---------------------------------------------------------------------

def test_random_like_draws_other_heads_of_the_model():
    geometry = Geometry(3, 4, None)  # 12 heads
    located, avoid = ["L2H3", "L0H1"], ["L1H0"]
    rng = np.random.default_rng(7)
    seen = set()
    for _ in range(200):
        drawn = random_like(located, geometry, rng, avoid)
        heads = parse_heads(drawn, 3, 4)  # heads (the kind of the located set), in the model
        assert len(drawn) == len(set(drawn)) == 2
        assert drawn == [str(h) for h in heads]  # sorted names
        assert not set(drawn) & {*located, *avoid}
        seen.update(drawn)
    assert seen == {f"L{layer}H{head}" for layer in range(3) for head in range(4)} - {
        *located, *avoid}  # every other head can be drawn
    # The same generator state draws the same sets.
    assert random_like(located, geometry, np.random.default_rng(3)) == \
        random_like(located, geometry, np.random.default_rng(3))
    with raises_naming(ValueError, "11 heads", "1", "12", "2"):  # taken, left, all, drawn
        random_like(["L0H0", "L0H1"], geometry, rng, [f"L{layer}H{h}" for layer in (1, 2)
                                                      for h in range(4)] + ["L0H2"])


def test_random_sets_are_seeded_per_task_and_more_draws_keep_the_first():
    located = list(LOCATED[:2])
    rng = np.random.default_rng([5, zlib.crc32(b"some_task")])
    by_hand: list[list[str]] = []  # in turn, a set drawn before skipped
    while len(by_hand) < 4:
        drawn = random_like(located, GEOMETRY, rng)
        by_hand += [drawn] if drawn not in by_hand else []
    assert random_sets(located, GEOMETRY, 4, 5, "some_task") == by_hand
    assert random_sets(located, GEOMETRY, 2, 5, "some_task") == by_hand[:2]
    assert random_sets(located, GEOMETRY, 4, 6, "some_task") != by_hand
    assert random_sets(located, GEOMETRY, 0, 5, "some_task") == []


def test_more_draws_than_distinct_random_sets_are_refused_before_any_is_drawn():
    """2 of the tiny model's 8 heads located: C(6, 2) = 15 distinct sets of 2 are left.
    More draws only repeat them; a billion was a verify that never ended."""
    from math import comb

    from lm_eval_headloc.common.checks import UsageError

    located = list(LOCATED[:2])
    assert comb(HEADS * LAYERS - 2, 2) == 15
    # All 15, each once (drawn with replacement, 15 draws held 10 distinct sets).
    every = random_sets(located, GEOMETRY, 15, 5, "some_task")
    assert len(every) == 15 and len({tuple(s) for s in every}) == 15
    assert every[:4] == random_sets(located, GEOMETRY, 4, 5, "some_task")
    with pytest.raises(UsageError) as refused:
        random_sets(located, GEOMETRY, 16, 5, "some_task")
    assert str(refused.value) == (
        "--random-draws 16: only 15 distinct random sets can be drawn (2 heads of the 6 "
        "outside the located set, --exclude and --never-ablate); give at most 15 (0 turns "
        "the baseline off)")
    # What is kept out shrinks the pool: C(5, 2) = 10; a mixed set multiplies its kinds'
    # counts: C(7, 1) * C(2 * 64 - 2, 2) (64 MLP neurons a layer).
    with raises_naming(UsageError, "--random-draws 11", "only 10 distinct", "at most 10"):
        random_sets(located, GEOMETRY, 11, 5, "some_task", avoid=["L0H1"])
    mixed = Geometry(LAYERS, HEADS, None, 64)
    distinct = 7 * comb(126, 2)
    assert len(random_sets(["L0H0", "L0N1", "L1N2"], mixed, 3, 5, "t")) == 3
    with raises_naming(UsageError, f"only {distinct:,} distinct", "1 head of the 7",
                       "2 MLP neurons of the 126", f"at most {distinct}"):
        random_sets(["L0H0", "L0N1", "L1N2"], mixed, distinct + 1, 5, "t")


# --- verify on a tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def enhanced(tiny_model_dir, tmp_path_factory):
    """verify --scale 2 with 3 random draws of the top-2 on a continuous task (perplexity)."""
    root = tmp_path_factory.mktemp("verify-baseline")
    run = finished_run(root / "run", tiny_model_dir("llama"), "tiny_copy_ppl", LOCATED, seed=3)
    out = root / "verify"
    assert harness("verify", str(run), "--top-k", "2", "--general", "tiny_copy",
                   "--random-draws", "3", "--scale", "2", "--out", str(out)) == 0
    return run, out


def _evaluate(model_dir: Path, heads: list[str], scale: float, task: str) -> float:
    """The task's score from a separate hf-headablate model (lm-eval's own evaluation)."""
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM
    from lm_eval_headloc.tasks import make_task_manager

    lm = HFHeadAblateLM(pretrained=str(model_dir), dtype="float32", device="cpu",
                        ablate="+".join(heads), scale=scale)
    results = lm_eval.simple_evaluate(model=lm, tasks=[task],
                                      task_manager=make_task_manager([TASKS]))
    return results["results"][task]["perplexity,none"]


def test_verify_draws_random_sets_and_measures_them_erased_and_enhanced(tiny_model_dir,
                                                                        enhanced):
    run, out = enhanced
    table = json.loads((out / "verify.json").read_text())
    task, located = "tiny_copy_ppl", list(LOCATED[:2])
    random = table["random"][task]
    # The draw, reproduced: the run's seed (3), the task, the model's 8 heads.
    assert random["sets"] == random_sets(located, GEOMETRY, 3, 3, task)
    for drawn in random["sets"]:
        assert len(parse_heads(drawn, LAYERS, HEADS)) == 2 and not set(drawn) & set(located)
    assert table["scale"] == 2.0 and table["random_draws"] == 3
    assert [a["name"] for a in random["ablations"]] == ["erase", "enhance"]
    # Every set measured at both scales: the erase entries carry their scale.
    records = {r["key"]: r for r in lines(out)}
    assert len(records) == 1 + 2 * (2 + 3)
    for key, record in records.items():
        assert record.get("scale") == (0.0 if key.endswith("-erase") else None), key
    assert records["tiny_copy_ppl-random2-erase"]["mask"] == "+".join(random["sets"][1])
    # The spread, recomputed from the stored records.
    base = records["baseline"]
    for against in random["ablations"]:
        suffix = "-erase" if against["name"] == "erase" else ""
        drops = [relative_drop(base["scores"][task], records[f"{task}-random{i}{suffix}"][
            "scores"][task], False) for i in (1, 2, 3)]
        own = relative_drop(base["scores"][task],
                            records[f"{task}-top2{suffix}"]["scores"][task], False)
        assert against["located"]["task_drop"] == pytest.approx(own)
        assert [d["task_drop"] for d in against["draws"]] == pytest.approx(drops)
        assert against["task_drop"]["mean"] == pytest.approx(np.mean(drops))
        assert against["task_drop"]["sd"] == pytest.approx(np.std(drops, ddof=1))
        assert against["task_drop"]["min"] == pytest.approx(min(drops))
        assert against["task_drop"]["max"] == pytest.approx(max(drops))
        assert against["beaten"] == sum(abs(d) < abs(own) for d in drops)
    # Erase and enhance side by side in each row; enhance (the run's --scale) as before.
    row = table["rows"][task][1]
    assert row["heads"] == located and set(row["erase"]) == set(row) - {"k", "heads", "erase"}
    assert row["score"] != pytest.approx(row["erase"]["score"])
    # The scores are lm-eval's own with the heads scaled by hf-headablate itself.
    model = tiny_model_dir("llama")
    assert row["score"] == pytest.approx(_evaluate(model, located, 2.0, task))
    assert row["erase"]["score"] == pytest.approx(_evaluate(model, located, 0.0, task))
    assert random["ablations"][0]["draws"][0]["score"] == pytest.approx(
        _evaluate(model, random["sets"][0], 0.0, task))
    text = (out / "verify.md").read_text()
    assert "| k | heads | erase (×0) score | Task drop | Gen drop | enhance (×2) score |" in text
    # k = 0: the measured baseline, for both ways of knocking out.
    unablated = base["scores"][task]
    assert f"| 0 | none (baseline) | {unablated:.4f} | – | – | {unablated:.4f} | – | – |" in text
    assert "## Against random heads: 3 sets of 2 per task (seed 3)" in text
    assert f"| {task} | enhance (×2) |" in text and f"| {task} | erase (×0) |" in text


def test_verify_resumes_and_more_draws_measure_only_the_new_sets(enhanced):
    run, out = enhanced
    before = lines(out)
    args = ["verify", str(run), "--top-k", "2", "--general", "tiny_copy", "--scale", "2",
            "--out", str(out)]
    assert harness(*args, "--random-draws", "3") == 0
    assert lines(out) == before  # nothing measured again
    assert harness(*args, "--random-draws", "4") == 0
    added = lines(out)[len(before):]
    assert sorted(r["key"] for r in added) == ["tiny_copy_ppl-random4",
                                               "tiny_copy_ppl-random4-erase"]
    table = json.loads((out / "verify.json").read_text())
    assert table["random"]["tiny_copy_ppl"]["sets"][:3] == random_sets(
        ["L1H2", "L0H0"], GEOMETRY, 3, 3, "tiny_copy_ppl")


def test_a_record_measured_at_another_scale_refuses_the_folder(tiny_model_dir, tmp_path,
                                                               capsys):
    run = finished_run(tmp_path / "run", tiny_model_dir("llama"), "tiny_copy_ppl", LOCATED)
    out = tmp_path / "verify"
    args = ["verify", str(run), "--top-k", "1", "--general", "tiny_copy", "--random-draws",
            "0", "--scale", "2", "--out", str(out)]
    assert harness(*args) == 0
    path = out / "measurements.jsonl"
    path.write_text(path.read_text().replace('"scale": 0.0', '"scale": 0.5'))
    assert harness(*args) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "measurement 'tiny_copy_ppl-top1-erase' on disk was made at scale 0.5, this run " \
           "plans scale 0" in message


@pytest.mark.parametrize("extra, message", [
    (["--random-draws", "-1"], "--random-draws -1: must be a whole number >= 0"),
    (["--random-draws", "x"], "argument --random-draws: 'x' is not a whole number"),
    # 4 located + 4 drawn fit the tiny model's 8 heads; 5 + 5 do not.
    (["--top-k", "5", "--random-draws", "1"],
     "--random-draws 1: 5 heads located or kept out leave 3 of the model's 8, fewer than a "
     "random set of 5 (0 turns the baseline off)"),
    # An audit's: accepted, then drawing a billion sets of the 15 there are never ended.
    (["--top-k", "2", "--random-draws", "1000000000"],
     "--random-draws 1000000000: only 15 distinct random sets can be drawn (2 heads of the "
     "6 outside the located set, --exclude and --never-ablate); give at most 15 (0 turns "
     "the baseline off)"),
])
def test_verify_checks_the_random_draws_before_loading(tiny_model_dir, tmp_path, capsys,
                                                       no_model_loading, extra, message):
    run = finished_run(tmp_path / "run", tiny_model_dir("llama"), "tiny_copy",
                       ("L1H2", "L0H0", "L0H3", "L1H0", "L0H1", "L1H1"))
    assert harness("verify", str(run), "--general", "tiny_choice", *extra) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (run / "verify").exists()


def test_moves_it_more_than_counts_by_the_scores_and_is_defined_at_a_zero_baseline():
    """'top-k moves it more than' counts the random sets whose score moved less than the
    top-k's, as verify.md says: at a baseline of 0 (an accuracy no knockout can lower) the
    relative drops it was counted by are undefined, and it said n/a of sets that a knockout
    raised by 0.1, 0.3 and not at all against the top-k's 0.2."""
    from types import SimpleNamespace

    from lm_eval_headloc.commands.verify import _against_random, ablations

    def record(score: float) -> dict:
        return {"scores": {"t": score}, "higher_is_better": {"t": True}}

    spec = SimpleNamespace(top_k=2, random_draws=3)
    for base, located, drawn, expected in [
            (0.0, 0.2, [0.1, 0.3, 0.0], 2),  # moved 0.1 and 0: less than 0.2
            (0.5, 0.3, [0.45, 0.1, 0.6], 2),  # moved 0.05, 0.4, 0.1 against 0.2
    ]:
        records = {"t-top2": record(located),
                   **{f"t-random{i + 1}": record(s) for i, s in enumerate(drawn)}}
        [own] = ablations(0.0)
        entry = _against_random(records, record(base), "t", [], spec, own)
        assert entry["beaten"] == expected, base
        if base:  # where relative drops are defined, the same count as theirs
            drops = [relative_drop(base, s, True) for s in drawn]
            mine = relative_drop(base, located, True)
            assert entry["beaten"] == sum(abs(d) < abs(mine) for d in drops)
