"""The commands that read a run's ranking take MLP neurons (L1N5) and mixed sets as they
take heads: verify (its random sets of the same make-up), cross and universal, on a tiny
random Llama (2 layers x 4 heads, MLPs 64 wide) with hand-written runs."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    HEADS,
    LAYERS,
    MLP_WIDTH,
    TASKS,
    assert_names,
    finished_run,
    harness,
    last_error,
    raises_naming,
)

from lm_eval_headloc.cli.main import main
from lm_eval_headloc.commands.verify import random_like, random_sets
from lm_eval_headloc.intervention.components import Head, Neuron, parse_components
from lm_eval_headloc.intervention.geometry import Geometry

GEOMETRY = Geometry(LAYERS, HEADS, 8, MLP_WIDTH)
NEURONS = ("L1N5", "L0N3", "L1N40", "L0N63")  # a neuron run's ranking, best first
MIXED = ("L1N5", "L0H2", "L0N3", "L1H1")  # a run of heads and neurons
PPL = "perplexity,none"


def records(folder: Path) -> dict[str, dict]:
    return {r["key"]: r for r in map(json.loads, (folder / "measurements.jsonl")
                                     .read_text().splitlines())}


def _evaluate(model_dir: Path, ablate: str, task: str, metric: str = PPL,
              scale: float = 0.0) -> float:
    """The task's score from a separate hf-headablate model (lm-eval's own evaluation)."""
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM
    from lm_eval_headloc.tasks import make_task_manager

    lm = HFHeadAblateLM(pretrained=str(model_dir), dtype="float32", device="cpu",
                        ablate=ablate or None, scale=scale)
    results = lm_eval.simple_evaluate(model=lm, tasks=[task],
                                      task_manager=make_task_manager([TASKS]))
    return results["results"][task][metric]


def _kinds(names: list[str]) -> tuple[int, int]:
    """(heads, neurons) in ``names``, which must be sorted, unique and in the tiny model."""
    parsed = parse_components(names, LAYERS, HEADS, MLP_WIDTH)
    assert [str(c) for c in parsed] == names
    return (sum(isinstance(c, Head) for c in parsed),
            sum(isinstance(c, Neuron) for c in parsed))


# --- the draw ---------------------------------------------------------------------------

def test_random_neurons_are_other_neurons_of_the_model():
    located = ["L1N5", "L0N3"]
    rng = np.random.default_rng(11)
    for _ in range(50):
        drawn = random_like(located, GEOMETRY, rng, ["L0H1"])
        assert _kinds(drawn) == (0, 2) and not set(drawn) & set(located)
    # The draw itself: two of the 128 neurons (flat: layer x 64 + neuron) less the
    # located two, without replacement, from a generator seeded alike.
    pool = sorted(set(range(2 * 64)) - {64 + 5, 3})
    picked = np.random.default_rng(4).choice(pool, size=2, replace=False)
    assert random_like(located, GEOMETRY, np.random.default_rng(4)) == [
        f"L{i // 64}N{i % 64}" for i in sorted(picked)]
    # Every other neuron can be drawn (here 2 layers of 3 neurons).
    small, seen = Geometry(2, 4, 8, 3), set()
    for _ in range(200):
        seen.update(random_like(["L0N0", "L1N2"], small, rng))
    assert seen == {"L0N1", "L0N2", "L1N0", "L1N1"}
    with raises_naming(ValueError, "5 MLP neurons", "1", "6", "2"):  # taken, left, all, drawn
        random_like(["L0N0", "L0N1"], small, rng, ["L0N2", "L1N0", "L1N1"])
    with raises_naming(ValueError, "MLP width"):
        random_like(located, Geometry(LAYERS, HEADS, 8, None), rng)


def test_a_mixed_set_draws_its_heads_as_a_set_of_heads_does_then_its_neurons():
    located = list(MIXED)  # 2 heads, 2 neurons
    for seed in range(5):
        drawn = random_like(located, GEOMETRY, np.random.default_rng(seed), ["L1H3"])
        assert _kinds(drawn) == (2, 2) and not set(drawn) & {*located, "L1H3"}
        # Heads first, from the generator as a set of heads alone takes it: the same heads.
        heads_only = random_like(["L0H2", "L1H1"], GEOMETRY, np.random.default_rng(seed),
                                 ["L1H3"])
        assert [n for n in drawn if "H" in n] == heads_only
    # Seeded per task, as heads' sets are; more draws keep the first.
    rng = np.random.default_rng([5, zlib.crc32(b"tiny_copy_ppl")])
    by_hand = [random_like(located, GEOMETRY, rng) for _ in range(3)]
    assert random_sets(located, GEOMETRY, 3, 5, "tiny_copy_ppl") == by_hand
    assert random_sets(located, GEOMETRY, 1, 5, "tiny_copy_ppl") == by_hand[:1]


# --- verify -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verified(tiny_model_dir, tmp_path_factory):
    """verify of a neuron run: top-2 and 2 random sets, on a perplexity task."""
    root = tmp_path_factory.mktemp("verify-neurons")
    run = finished_run(root / "run", tiny_model_dir("llama"), "tiny_copy_ppl", NEURONS, seed=3)
    out = root / "verify"
    assert harness("verify", str(run), "--top-k", "2", "--general", "tiny_copy",
                   "--random-draws", "2", "--out", str(out)) == 0
    return run, out


def test_verify_knocks_out_exactly_the_located_neurons(tiny_model_dir, verified):
    run, out = verified
    table, measured = json.loads((out / "verify.json").read_text()), records(out)
    task = "tiny_copy_ppl"
    assert measured[f"{task}-top1"]["mask"] == "L1N5"
    assert measured[f"{task}-top2"]["mask"] == "L0N3+L1N5"
    assert [row["heads"] for row in table["rows"][task]] == [["L1N5"], ["L1N5", "L0N3"]]
    # The score is lm-eval's own with those two neurons knocked out by hf-headablate.
    model = tiny_model_dir("llama")
    top2 = table["rows"][task][1]["score"]
    assert top2 == pytest.approx(_evaluate(model, "L1N5+L0N3", task))
    assert top2 != pytest.approx(table["baseline"][task])  # something was knocked out
    text = (out / "verify.md").read_text()
    assert "# Verification: cumulative knockout of the top MLP neurons" in text
    assert "| k | MLP neurons | score |" in text
    assert "## Against random MLP neurons: 2 sets of 2 per task (seed 3)" in text


def test_verify_draws_random_neurons_of_the_located_count(tiny_model_dir, verified):
    run, out = verified
    table, measured = json.loads((out / "verify.json").read_text()), records(out)
    sets = table["random"]["tiny_copy_ppl"]["sets"]
    assert sets == random_sets(list(NEURONS[:2]), GEOMETRY, 2, 3, "tiny_copy_ppl")
    for i, drawn in enumerate(sets, start=1):
        assert _kinds(drawn) == (0, 2) and not set(drawn) & set(NEURONS[:2])
        assert measured[f"tiny_copy_ppl-random{i}"]["mask"] == "+".join(drawn)
    assert table["random"]["tiny_copy_ppl"]["ablations"][0]["draws"][0]["score"] == \
        pytest.approx(_evaluate(tiny_model_dir("llama"), "+".join(sets[0]), "tiny_copy_ppl"))


def test_verify_enhances_and_erases_neurons(tiny_model_dir, tmp_path):
    """verify --scale 2 of a neuron run: CNL's enhance (the neurons doubled) next to erase,
    each against lm-eval's own evaluation of a separate hf-headablate model."""
    run = finished_run(tmp_path / "run", tiny_model_dir("llama"), "tiny_copy_ppl", NEURONS,
                       seed=3)
    out = tmp_path / "verify"
    assert harness("verify", str(run), "--top-k", "2", "--general", "tiny_copy",
                   "--random-draws", "1", "--scale", "2", "--out", str(out)) == 0
    table, measured = json.loads((out / "verify.json").read_text()), records(out)
    task, model = "tiny_copy_ppl", tiny_model_dir("llama")
    assert measured[f"{task}-top2"]["mask"] == "L0N3+L1N5"
    assert measured[f"{task}-top2"].get("scale") is None  # the run's --scale: 2
    assert measured[f"{task}-top2-erase"]["scale"] == 0.0
    row = table["rows"][task][1]
    assert row["score"] == pytest.approx(_evaluate(model, "L1N5+L0N3", task, scale=2.0))
    assert row["erase"]["score"] == pytest.approx(_evaluate(model, "L1N5+L0N3", task))
    assert row["score"] != pytest.approx(row["erase"]["score"])
    random = table["random"][task]
    assert [a["name"] for a in random["ablations"]] == ["erase", "enhance"]
    drawn = random["sets"][0]
    assert _kinds(drawn) == (0, 2) and not set(drawn) & {"L1N5", "L0N3"}
    enhance = random["ablations"][1]["draws"][0]["score"]
    assert enhance == pytest.approx(_evaluate(model, "+".join(drawn), task, scale=2.0))
    assert "## Against random MLP neurons: 1 set of 2 per task (seed 3)" in \
        (out / "verify.md").read_text()


def test_verify_of_a_mixed_run_draws_the_same_mix(tiny_model_dir, tmp_path):
    run = finished_run(tmp_path / "run", tiny_model_dir("llama"), "tiny_copy", MIXED)
    out = tmp_path / "verify"
    assert harness("verify", str(run), "--top-k", "3", "--general", "tiny_copy_ppl",
                   "--random-draws", "2", "--out", str(out)) == 0
    table, measured = json.loads((out / "verify.json").read_text()), records(out)
    assert measured["tiny_copy-top3"]["mask"] == "L0H2+L0N3+L1N5"
    for i, drawn in enumerate(table["random"]["tiny_copy"]["sets"], start=1):
        assert _kinds(drawn) == (1, 2) and not set(drawn) & set(MIXED[:3])
        assert measured[f"tiny_copy-random{i}"]["mask"] == "+".join(drawn)
    text = (out / "verify.md").read_text()
    assert "## Against random components: 2 sets of 3 per task" in text
    assert "as many heads and as many MLP neurons as the task's top-k" in text


def of_wider_model(run: Path) -> Path:
    """``run`` recording twice the tiny model's MLP width, as a run of a wider model would:
    its neurons past the tiny model's width agree with its own config.json."""
    config = json.loads((run / "config.json").read_text())
    config["neurons_per_layer"] = 2 * MLP_WIDTH
    (run / "config.json").write_text(json.dumps(config))
    return run


def test_verify_of_neurons_checks_before_loading(tiny_model_dir, tmp_path, capsys,
                                                 no_model_loading, monkeypatch):
    model = tiny_model_dir("llama")
    ranking = tuple(f"L{i % 2}N{i}" for i in range(10))
    # A top-k past the model's 8 heads is fine for 10 neurons: only the model's loading
    # (refused here) stops it.
    many = finished_run(tmp_path / "many", model, "tiny_copy", ranking)
    with pytest.raises(AssertionError, match="the model was loaded"):
        harness("verify", str(many), "--general", "tiny_choice", "--top-k", "9")
    run = finished_run(tmp_path / "run", model, "tiny_copy", ranking)
    args = ["verify", str(run), "--general", "tiny_choice", "--random-draws", "1"]
    # A neuron past the MLP's width fails before loading (the run's of a wider model: a
    # folder whose own width lacks its neurons is refused as disagreeing with itself).
    wide = of_wider_model(finished_run(tmp_path / "wide", model, "tiny_copy",
                                       ("L1N64", "L0N1")))
    assert harness("verify", str(wide), "--general", "tiny_choice", "--top-k", "2") == 2
    assert_names(last_error(capsys), "L1N64", "0..63")
    # A config that does not give the MLP's width, and a run that did not record it
    # (test_verify_draws_random_neurons_where_only_the_run_knows_the_mlp_width: one that
    # did): no random neurons before loading.
    from lm_eval_headloc.runs import setup as engine

    unknown = Geometry(LAYERS, HEADS, 8, None)
    monkeypatch.setattr(engine, "config_geometry", lambda config: unknown)
    config = json.loads((run / "config.json").read_text())
    del config["neurons_per_layer"]
    (run / "config.json").write_text(json.dumps(config))
    assert harness(*args, "--top-k", "2") == 2
    assert_names(last_error(capsys), "--random-draws 1", f"pretrained={model}", "MLP width",
                 "0")  # what it lacks, and the value that turns the baseline off
    assert not (run / "verify").exists() and not (wide / "verify").exists()


# --- cross ------------------------------------------------------------------------------

def test_cross_of_a_neuron_run_and_a_head_run(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    runs = [finished_run(tmp_path / "neurons", model, "tiny_copy_ppl", NEURONS),
            finished_run(tmp_path / "heads", model, "tiny_rolling",
                         ("L0H1", "L1H3", "L1H2"))]
    out = tmp_path / "cross"
    # --num-samples 12: every document of the 12-document tasks, as lm-eval's own run.
    assert harness("cross", *map(str, runs), "--top-k", "2", "--num-samples", "12",
                   "--out", str(out)) == 0
    table, measured = json.loads((out / "cross.json").read_text()), records(out)
    assert [s["heads"] for s in table["sets"]] == [["L1N5", "L0N3"], ["L0H1", "L1H3"]]
    assert measured["set1"]["mask"] == "L0N3+L1N5"
    assert measured["set2"]["mask"] == "L0H1+L1H3"
    erase = table["ablations"][0]
    assert erase["scores"][f"{runs[0]}:tiny_copy_ppl"]["tiny_rolling"] == pytest.approx(
        _evaluate(model, "L1N5+L0N3", "tiny_rolling", "word_perplexity,none"))
    text = (out / "cross.md").read_text()
    assert "each run's top-2 components per task" in text
    assert "| set knocked out | components | tiny_copy_ppl | tiny_rolling |" in text
    assert "| L1N5+L0N3 |" in text


def test_cross_enhances_a_neuron_set(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    run = finished_run(tmp_path / "neurons", model, "tiny_copy_ppl", NEURONS)
    out = tmp_path / "cross"
    assert harness("cross", str(run), "--top-k", "2", "--scale", "2", "--tasks",
                   "tiny_copy_ppl,tiny_rolling", "--num-samples", "12",
                   "--out", str(out)) == 0
    table = json.loads((out / "cross.json").read_text())
    erase, enhance = table["ablations"]
    assert (erase["name"], enhance["name"], enhance["scale"]) == ("erase", "enhance", 2.0)
    label = f"{run}:tiny_copy_ppl"
    assert enhance["scores"][label]["tiny_rolling"] == pytest.approx(
        _evaluate(model, "L1N5+L0N3", "tiny_rolling", "word_perplexity,none", scale=2.0))
    assert erase["scores"][label]["tiny_copy_ppl"] == pytest.approx(
        _evaluate(model, "L1N5+L0N3", "tiny_copy_ppl"))


def test_cross_takes_a_neuron_top_k_larger_than_the_models_heads(tiny_model_dir, tmp_path):
    """cross --top-k 9 of a run ranking 10 neurons was refused: 'the model has only 8
    heads' (the check of a heads run's --top-k, made of cross's own spec)."""
    ranked = tuple(f"L0N{n}" for n in range(10))
    run = finished_run(tmp_path / "neurons", tiny_model_dir("llama"), "tiny_copy", ranked)
    out = tmp_path / "cross"
    assert harness("cross", str(run), "--top-k", "9", "--num-samples", "4",
                   "--out", str(out)) == 0
    assert records(out)["set1"]["mask"] == "+".join(ranked[:9])


def test_cross_refuses_a_neuron_outside_the_model_before_loading(tiny_model_dir, tmp_path,
                                                                  capsys, no_model_loading):
    run = of_wider_model(finished_run(tmp_path / "run", tiny_model_dir("llama"), "tiny_copy",
                                      ("L0N70", "L1N2")))
    assert harness("cross", str(run), "--top-k", "2", "--out", str(tmp_path / "c")) == 2
    assert_names(last_error(capsys), "L0N70", "0..63")


# --- universal --------------------------------------------------------------------------

def test_universal_counts_neurons_as_it_counts_heads(tiny_model_dir, tmp_path, capsys,
                                                     no_model_loading):
    model = tiny_model_dir("llama")
    runs = [finished_run(tmp_path / "a", model, "tiny_copy_ppl",
                         ("L1N5", "L0N3", "L0N7", "L1N9")),
            finished_run(tmp_path / "b", model, "tiny_rolling",
                         ("L0N3", "L1N9", "L1N5", "L0N7"))]
    out = tmp_path / "universal.json"
    assert harness("universal", *map(str, runs), "--top-k", "3", "--min-tasks", "2",
                   "--out", str(out)) == 0
    result = json.loads(out.read_text())
    a, b = (f"{Path(run).resolve()}:{task}" for run, task in
            zip(runs, ("tiny_copy_ppl", "tiny_rolling"), strict=True))
    # In both top-3s: L0N3 (ranks 2 and 1, sum 3) before L1N5 (1 and 3, sum 4).
    assert result["heads"] == [
        {"head": "L0N3", "tasks": 2, "ranks": {a: 2, b: 1}},
        {"head": "L1N5", "tasks": 2, "ranks": {a: 1, b: 3}}]
    assert result["candidates"] == {"L0N3": {a: 2, b: 1}, "L0N7": {a: 3},
                                    "L1N5": {a: 1, b: 3}, "L1N9": {b: 2}}
    assert "| L0N3 | 2 | 2 | 1 |" in capsys.readouterr().out
    # A heads run's --never-ablate takes heads only: a universal neuron is refused, by
    # name, before the model loads, saying which runs take neurons.
    assert harness("locate", "--model-args", f"pretrained={model},dtype=float32,device=cpu",
                   "--tasks", "tiny_copy", "--include-path", TASKS, "--never-ablate",
                   str(out), "--out", str(tmp_path / "loc")) == 2
    assert_names(last_error(capsys), "--never-ablate", "'L0N3'",
                 "--components neurons or heads+neurons")


def test_verifys_header_counts_what_a_random_set_knocks_out():
    # A top-3 with a neuron group knocks out 12 neurons: the random sets are that large,
    # and the header once said "sets of 3".
    from lm_eval_headloc.commands.verify import verification_markdown

    top = ["L0N1+L0N2+L0N3+L0N4+L0N5+L0N6+L0N7+L0N8+L0N9+L0N10", "L1N1", "L1N2"]
    drawn = [[f"L1N{i}" for i in range(10, 22)], [f"L0N{i}" for i in range(20, 32)]]
    table = {"general": [], "scale": 0.0, "baseline": {"t": 1.0}, "metrics": {"t": "acc"},
             "random_draws": 2,
             "rows": {"t": [{"k": 3, "heads": top, "score": 0.5, "task_drop": 0.5,
                             "gen_drop": None, "general_scores": {}}]},
             "random": {"t": {"k": 3, "seed": 7, "sets": drawn, "ablations": []}}}
    assert "## Against random MLP neurons: 2 sets of 12 per task (seed 7)" in \
        verification_markdown(table)


def test_erase_and_enhance_say_what_they_are_under_mean_or_resample_ablation():
    """CNL's erase and enhance zero and double the output; under mean (or resample)
    ablation ×0 and ×2 are r and z + (z − r): verify.md and cross.md say so."""
    from lm_eval_headloc.commands.cross import cross_markdown
    from lm_eval_headloc.commands.verify import verification_markdown

    rows = {"t": [{"k": 1, "heads": ["L1N1"], "score": 0.5, "task_drop": 0.5,
                   "gen_drop": None, "general_scores": {},
                   "erase": {"score": 0.4, "task_drop": 0.6, "gen_drop": None}}]}
    verify = {"general": [], "scale": 2.0, "baseline": {"t": 1.0}, "metrics": {"t": "acc"},
              "random_draws": 0, "rows": rows}
    matrix = {"name": "erase", "scale": 0.0, "scores": {"r:t": {"t": 0.4}},
              "drops": {"r:t": {"t": 0.6}}, "hurts_others": {"r:t": []}}
    cross = {"model_args": "pretrained=x", "top_k": 1, "tasks": ["t"], "metrics": {"t": "acc"},
             "baseline": {"t": 1.0}, "ablations": [matrix],
             "sets": [{"label": "r:t", "run": "r", "task": "t", "heads": ["L1N1"]}]}
    for kind, reference in (("mean", "its mean over the reference examples"),
                            ("resample", "its output on a donor example")):
        for text in (verification_markdown({**verify, "ablation": kind}),
                     cross_markdown({**cross, "ablation": kind})):
            assert (f"Knocked out by {kind} ablation: at scale S a component's output z "
                    f"becomes r + S·(z − r), r {reference}; ×0 puts r in its place and ×2 "
                    "doubles its difference from r") in text
    for table in ({**verify, "ablation": "zero"}, verify):  # zero, or a run from before
        assert "Knocked out by" not in verification_markdown(table)
    assert "Knocked out by" not in cross_markdown({**cross, "ablation": "zero"})


def test_verify_draws_random_neurons_where_only_the_run_knows_the_mlp_width(tmp_path):
    """BLOOM's config gives no MLP width; a neuron run takes it from the weights and
    records it, and verify's random neuron sets (on by default) were refused."""
    import torch
    import transformers
    from helpers import save_tiny_tokenizer

    folder = tmp_path / "bloom"
    config = transformers.BloomConfig(vocab_size=300, hidden_size=32, n_layer=2, n_head=4,
                                      bos_token_id=1, eos_token_id=2)
    assert Geometry.from_config(config).neurons_per_layer is None
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    model = ["--model-args", f"pretrained={folder},dtype=float32", "--include-path", TASKS]
    run = tmp_path / "run"
    assert main(["locate", *model, "--tasks", "tiny_copy", "--num-samples", "8",
                 "--signal", "logprob", "--prior", "atp", "--components", "neurons",
                 "--candidates", "8", "--masks", "6", "--confirm", "2", "--top-k", "2",
                 "--out", str(run)]) == 0
    assert json.loads((run / "config.json").read_text())["neurons_per_layer"] == 128
    out = tmp_path / "verify"
    assert main(["verify", str(run), "--top-k", "2", "--random-draws", "2",
                 "--general", "tiny_choice", "--out", str(out)]) == 0
    drawn = json.loads((out / "verify.json").read_text())["random"]["tiny_copy"]["sets"]
    neurons = [parse_components([n])[0] for s in drawn for n in s]
    assert len(drawn) == 2 and all(isinstance(n, Neuron) and n[1] < 128 for n in neurons)


def test_a_neuron_group_is_one_component_in_the_words(tiny_model_dir, tmp_path, capsys,
                                                      no_model_loading):
    """A ranking's neuron group (its neurons '+'-joined) was called MLP neurons: verify
    said "ranks only 3 MLP neurons" of 2 neurons and a group, and cross titled a set
    knocking out 4 neurons "the top-3 MLP neurons"."""
    from lm_eval_headloc.commands.verify import kind_words

    assert kind_words(["L0N1+L0N2", "L1N5"]) == "components"
    assert kind_words(["L0N1+L0N2"], plural=False) == "neuron group"
    assert kind_words(["L0N1", "L1N5"]) == "MLP neurons"
    assert kind_words(["L0H1", "L1H2"]) == "heads"
    assert kind_words(["L0H1", "L1N2"]) == "components"
    run = finished_run(tmp_path / "run", tiny_model_dir("llama"), "tiny_copy",
                       ("L0N1+L0N2", "L1N5", "L0N3"))
    assert harness("verify", str(run), "--general", "tiny_choice", "--top-k", "5") == 2
    assert_names(last_error(capsys), "--top-k 5", "ranks only 3 components")
