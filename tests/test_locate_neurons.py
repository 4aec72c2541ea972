"""``locate --components neurons|heads+neurons``: the prior names neuron candidates, the
masks and the confirmation search them as they search heads, and every file says so."""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import pytest
from helpers import (
    assert_names,
    assert_same_run,
    harness,
    raises_naming,
    read_run,
    stopped_part_way,
    strict_json,
    tiny_args,
)
from helpers import measurement_lines as read_run_lines

from lm_eval_headloc.intervention.components import Head, Neuron, parse_components
from lm_eval_headloc.method.columns import Columns, neuron_candidates
from lm_eval_headloc.runs.record import column_prior

# --- columns and candidates, by hand ----------------------------------------------------


def test_columns_of_each_kind():
    heads = Columns.of("heads", 2, 3)
    assert list(heads) == [Head(0, 0), Head(0, 1), Head(0, 2), Head(1, 0), Head(1, 1),
                           Head(1, 2)]
    assert heads.heads_grid == (2, 3) and not heads.has_neurons
    neurons = Columns.of("neurons", 2, 3, ["L1N4", "L0N7"])
    assert list(neurons) == [Neuron(0, 7), Neuron(1, 4)]  # layer order, whatever the prior's
    assert neurons.heads_grid is None and neurons.has_neurons
    both = Columns.of("heads+neurons", 2, 3, ["L1N4"])
    assert len(both) == 7 and both[6] == Neuron(1, 4) and both.index(Head(1, 2)) == 5
    assert both.knocked_out(np.array([1, 0, 0, 0, 0, 0, 1], dtype=bool)) == [Head(0, 0),
                                                                             Neuron(1, 4)]
    with raises_naming(KeyError, "L0N4"):
        both.index(Neuron(0, 4))


def test_neuron_candidates_take_each_ranking_in_turn():
    # 2 layers x 3 neurons; flat index = layer * 3 + neuron. Most negative = most harmful.
    estimates = {
        "a": np.array([[-5.0, 0, 0, 0, -1, 0],     # point 0: L0N0, then L1N1
                       [0, 0, -2, 0, 0, -3.0]]),   # point 1: L1N2, then L0N2
        "b": np.array([[0, -4.0, 0, 0, 0, 0]]),    # L0N1
    }
    # Turns: a@0 -> L0N0, a@1 -> L1N2, b@0 -> L0N1, a@0 -> L1N1, a@1 -> L0N2, ...
    assert neuron_candidates(estimates, 3, 5) == [Neuron(0, 0), Neuron(1, 2), Neuron(0, 1),
                                                  Neuron(1, 1), Neuron(0, 2)]


def test_column_prior_takes_each_columns_own_estimate():
    columns = Columns.of("heads+neurons", 2, 2, ["L1N2", "L0N0"])
    priors = {"t": {"heads": np.array([[1.0, 2, 3, 4]]),
                    "neurons": np.array([[10.0, 11, 12, 13, 14, 15]])}}  # width 3
    # Columns: L0H0 L0H1 L1H0 L1H1 L0N0 L1N2 -> heads 1..4, neurons flat 0 and 5.
    assert column_prior(priors, columns, 2, 3)["t"].tolist() == [[1, 2, 3, 4, 10, 15]]


# --- end to end on a tiny model ---------------------------------------------------------

def neuron_args(folder, *options: str) -> list[str]:
    return ["locate", *tiny_args(folder), "--tasks", "tiny_copy", "--num-samples", "12",
            "--seed", "3", "--sparsity", "0.25", "--masks", "10", "--confirm", "4",
            "--prior", "atp", "--top-k", "3", *options]


@pytest.fixture(scope="module")
def neuron_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("neurons") / "run"
    args = neuron_args(tiny_model_dir("llama"), "--components", "neurons",
                       "--candidates", "16")
    assert harness(*args, "--out", str(out)) == 0
    return out, args


def test_a_neuron_run_searches_the_priors_candidates(neuron_run):
    out, _ = neuron_run
    config = strict_json(out / "config.json")
    assert config["spec"]["components"] == "neurons"
    assert config["neurons_per_layer"] == 64
    candidates = parse_components(config["candidates"])
    assert len(candidates) == 16 and all(isinstance(c, Neuron) for c in candidates)
    # The candidates are the prior's likeliest, computed again from prior.json.
    prior = json.loads((out / "prior.json").read_text())
    estimates = {t: np.array([p["neuron_effects"] for p in e["points"]])
                 for t, e in prior["tasks"].items()}
    assert sorted(candidates) == sorted(neuron_candidates(estimates, 64, 16))
    design = np.load(out / "design_matrix.npy")
    assert design.shape == (10, 16)
    records, heads = read_run(out)
    columns = Columns.of("neurons", 2, 4, config["candidates"])
    by_key = {r["key"]: r for r in records}
    for key, row in zip(config["row_keys"], design, strict=True):
        assert parse_components(by_key[key]["mask"]) == columns.knocked_out(row)
    alone = [r for r in records if r["key"].startswith("alone-")]
    assert len(alone) == 4 and all(isinstance(parse_components(r["mask"])[0], Neuron)
                                   for r in alone)
    assert {e["neuron"] for e in heads["heads"]} == {str(c) for c in candidates}
    assert all("head" not in e for e in heads["heads"])
    assert heads["top_k"] == [e["neuron"] for e in heads["heads"][:3]]
    csv = (out / "heads.csv").read_text().splitlines()
    assert csv[0].startswith("rank,component,kind,layer,index_in_layer,effect")
    assert csv[1].split(",")[2] == "neuron"
    assert (out / "heatmap.png").stat().st_size > 0


def test_a_neuron_runs_top_k_is_an_ablate_file(neuron_run, tiny_model_dir):
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    out, _ = neuron_run
    heads = strict_json(out / "heads.json")
    lm = HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), device="cpu",
                        dtype="float32", ablate_file=str(out / "heads.json"), ablate_top=3)
    assert [str(c) for c in lm.knocked_out] == sorted(heads["top_k"], key=lambda n: (
        int(n[1:n.index("N")]), int(n[n.index("N") + 1:])))


def test_a_rerun_measures_nothing_and_refit_reads_it(neuron_run):
    out, args = neuron_run
    before = (out / "measurements.jsonl").read_text()
    heads = (out / "heads.json").read_text()
    assert harness(*args, "--out", str(out)) == 0
    assert (out / "measurements.jsonl").read_text() == before
    assert (out / "heads.json").read_text() == heads
    assert harness("refit", str(out), "--top-k", "2") == 0
    assert strict_json(out / "heads.json")["top_k"] == json.loads(heads)["top_k"][:2]
    # --exclude takes the run's neurons: the first leaves the ranking, nothing is measured.
    first = json.loads(heads)["top_k"][0]
    assert harness(*args, "--exclude", first, "--out", str(out)) == 0
    assert (out / "measurements.jsonl").read_text() == before
    refitted = strict_json(out / "heads.json")
    refitted_text = (out / "heads.json").read_text()
    assert first not in [e["neuron"] for e in refitted["heads"]]
    assert refitted["excluded"] == [first] and len(refitted["top_k"]) == 3
    # An --exclude of every candidate leaves nothing: refused as refit refuses it.
    every = "+".join(strict_json(out / "config.json")["candidates"])
    assert harness(*args, "--exclude", every, "--out", str(out)) == 2
    assert harness("refit", str(out), "--exclude", every) == 2
    assert harness("refit", str(out)) == 0  # the refused rerun recorded no --exclude
    # All but 2 candidates excluded under --top-k 3: a top-3 of 2 neurons, refused.
    all_but_two = "+".join(strict_json(out / "config.json")["candidates"][2:])
    assert harness(*args, "--exclude", all_but_two, "--out", str(out)) == 2
    assert harness("refit", str(out), "--exclude", all_but_two) == 2
    assert (out / "heads.json").read_text() == refitted_text


def test_heads_and_neurons_share_one_design(tiny_model_dir, tmp_path):
    out = tmp_path / "both"
    args = neuron_args(tiny_model_dir("llama"), "--components", "heads+neurons",
                       "--candidates", "8")
    assert harness(*args, "--out", str(out)) == 0
    config = strict_json(out / "config.json")
    assert np.load(out / "design_matrix.npy").shape == (10, 8 + 8)
    prior = json.loads((out / "prior.json").read_text())
    point = next(iter(prior["tasks"].values()))["points"][0]
    assert len(point["effects"]) == 8 and len(point["neuron_effects"]) == 2 * 64
    names = [e.get("head", e.get("neuron")) for e in strict_json(out / "heads.json")["heads"]]
    assert sorted(names) == sorted([f"L{layer}H{h}" for layer in range(2) for h in range(4)]
                                   + config["candidates"])


def test_a_kill_mid_run_resumes_to_the_same_neurons(tiny_model_dir, tmp_path):
    args = neuron_args(tiny_model_dir("llama"), "--components", "neurons",
                       "--candidates", "16", "--confirm", "10")
    full = tmp_path / "full"
    assert harness(*args, "--out", str(full)) == 0
    measured = len((full / "measurements.jsonl").read_text().splitlines())
    assert measured == 1 + 10 + 10
    killed = tmp_path / "killed"
    # Killed after the 13th measurement (in confirmation), with 8 left for the kill to
    # land in before the run ends (a tiny model's measurements take milliseconds).
    partial = stopped_part_way(args, killed, after=13, stop=signal.SIGKILL)
    assert 13 <= partial < measured, "the run was not interrupted part-way"
    assert harness(*args, "--out", str(killed)) == 0
    assert_same_run(killed, full)
    assert strict_json(killed / "config.json")["candidates"] == \
        strict_json(full / "config.json")["candidates"]


@pytest.mark.parametrize("options, message", [
    (["--components", "neurons", "--prior", "none"],
     "--components neurons needs the attribution prior"),
    (["--components", "neurons", "--candidates", "0"], "--candidates 0: must be a whole"),
    (["--components", "neurons", "--candidates", "999"],
     "--candidates 999: the model has only 128 MLP neurons"),
    (["--components", "cells"], "invalid choice: 'cells'"),
    (["--components", "neurons", "--never-ablate", "L1N64"],
     "--never-ablate: neuron L1N64 is outside the model: neuron 64 not in 0..63"),
    (["--components", "neurons", "--exclude", "L2N0"],
     "--exclude: neuron L2N0 is outside the model: layer 2 not in 0..1"),
    (["--components", "neurons", "--candidates", "100", "--never-ablate", "L0N*"],
     "--candidates 100: --never-ablate keeps 64 of the model's 128 MLP neurons out, "
     "leaving 64"),
    (["--exclude", "L0N1"], "--exclude: 'L0N1' is an MLP neuron; only attention heads"),
    # Every neuron a candidate: the groups had nothing to hold and were ignored silently.
    (["--components", "neurons", "--candidates", "128", "--neuron-groups", "2"],
     "--neuron-groups 2: --candidates 128 take every one of the model's 128 MLP neurons"),
    (["--components", "neurons", "--candidates", "64", "--never-ablate", "L1N*",
      "--neuron-groups", "2"], "--neuron-groups 2: --candidates 64 and --never-ablate's 64 "
     "take every one of the model's 128 MLP neurons"),
    # Every neuron excluded: the run measured and wrote an empty ranking, "certified".
    (["--components", "neurons", "--exclude", "L0N*+L1N*"],
     "--exclude covers every component the run ranks (8); nothing is left to rank"),
    # Its neurons were left to rank: "nothing is left to rank" was false.
    (["--components", "heads+neurons", "--never-ablate", "L0H*+L1H*"],
     "--never-ablate covers every head (8); to rank MLP neurons alone, give --components "
     "neurons"),
])
def test_bad_neuron_options_are_one_line(tiny_model_dir, tmp_path, capsys, options, message):
    out = tmp_path / "bad"
    code = harness(*neuron_args(tiny_model_dir("llama"), *options), "--out", str(out))
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.slow
def test_embedded_neuron_run_keeps_the_default_budget(smollm2, tmp_path):
    """The embedded model's 46,080 neurons, default settings on a few examples: the prior
    names 270 candidates (as many as the heads), then 12 masks and 34 alone — the default
    budget's split, as for heads."""
    from lm_eval_headloc.method.budget import DEFAULT_ALONE, DEFAULT_MASKS

    out = tmp_path / "run"
    # --max-measurements 54: the default budget before the group tests (they are the
    # heads' run's, tested in test_end_to_end), to keep this run short.
    assert harness("locate", "--components", "neurons", "--num-samples", "16",
                   "--max-measurements", "54", "--out", str(out)) == 0
    config = strict_json(out / "config.json")
    assert config["neurons_per_layer"] == 1536 and len(config["candidates"]) == 30 * 9
    assert np.load(out / "design_matrix.npy").shape == (DEFAULT_MASKS, 270)
    records, heads = read_run(out)
    assert len(records) == 1 + DEFAULT_MASKS + DEFAULT_ALONE
    # Its certificate is over its 270 candidates, and says the rest was not searched.
    cert = heads["certificate"]
    assert cert["measured_alone"] + cert["ruled_out"] + len(cert["unchecked"]) == 270
    assert cert["measurements_spent"] == 54 and not cert["certified"]
    report = (out / "report.md").read_text()
    assert (f"The model's other {30 * 1536 - 270:,} neurons were not searched") in report
    assert json.loads((out / "prior.json").read_text())["kinds"] == ["neurons"]
    top = heads["top_k"]
    assert len(top) == 5 and all(isinstance(c, Neuron) for c in parse_components(top))
    assert all(name in report for name in top)


def test_a_sweep_of_neurons_checks_each_cells_top_k(tiny_model_dir, tmp_path):
    sweep = tmp_path / "sweep"
    assert harness("sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--components", "neurons", "--candidates", "8", "--prior", "atp",
                   "--masks", "4,6", "--sparsity", "0.25", "--num-samples", "6",
                   "--top-k", "2", "--out", str(sweep)) == 0
    result = strict_json(sweep / "sweep.json")
    records = {r["key"]: r for r in read_run_lines(sweep)}
    for cell in result["cells"]:
        name = f"m{cell['masks']}-p{cell['sparsity']:g}"
        config = strict_json(sweep / name / "config.json")
        assert len(config["candidates"]) == 8
        top = strict_json(sweep / name / "heads.json")["top_k"]
        assert all(isinstance(c, Neuron) for c in parse_components(top))
        assert parse_components(records[f"{name}-top2"]["mask"]) == parse_components(top)


# --- neuron groups (--neuron-groups) ------------------------------------------------------

def test_neuron_groups_cut_the_rest_of_each_layer_in_index_order():
    from lm_eval_headloc.method.columns import NeuronGroup, neuron_groups

    # 2 layers x 6 neurons, candidates L0N1 and L1N5, 2 groups a layer: by hand,
    # layer 0 leaves 0 2 3 4 5 -> (0 2 3) (4 5); layer 1 leaves 0..4 -> (0 1 2) (3 4).
    groups = neuron_groups([Neuron(0, 1), Neuron(1, 5)], 2, 6, 2)
    assert groups == [NeuronGroup(0, 0, (0, 2, 3)), NeuronGroup(0, 1, (4, 5)),
                      NeuronGroup(1, 0, (0, 1, 2)), NeuronGroup(1, 1, (3, 4))]
    # More groups than neurons left: one neuron each, no empty group.
    assert [g.neurons for g in neuron_groups([Neuron(0, 0)], 1, 3, 5)] == [(1,), (2,)]
    columns = Columns.of("neurons", 2, 4, ["L1N5", "L0N1"], 2, 6)
    assert [str(c) for c in columns] == ["L0N1", "L1N5", "L0G0", "L0G1", "L1G0", "L1G1"]
    # A group's key is not a head's with the same numbers.
    both = Columns.of("heads+neurons", 2, 2, ["L0N1"], 1, 6)
    assert both.index(Head(0, 0)) == 0 and both.named("L0G0") == 5
    row = np.array([0, 0, 0, 0, 1, 1, 0], dtype=bool)  # L0N1 and L0G0
    assert both.knocked_out(row) == [Neuron(0, 1), Neuron(0, 0), Neuron(0, 2), Neuron(0, 3),
                                     Neuron(0, 4), Neuron(0, 5)]
    assert both.members(6) == [Neuron(1, n) for n in range(6)]
    # Neurons never knocked out are in no group: layer 0 leaves 0 3 4 5 -> (0 3) (4 5);
    # a layer with every neuron taken has no group.
    groups = neuron_groups([Neuron(0, 1)], 2, 6, 2, never=[Neuron(0, 2)] + [
        Neuron(1, n) for n in range(6)])
    assert groups == [NeuronGroup(0, 0, (0, 3)), NeuronGroup(0, 1, (4, 5))]
    columns = Columns.of("neurons", 2, 4, ["L0N1"], 2, 6, never=["L0N2", "L1N0"])
    assert [c.neurons for c in columns.components[1:]] == [(0, 3), (4, 5), (1, 2, 3),
                                                          (4, 5)]


def test_a_group_has_no_prior_of_its_own():
    columns = Columns.of("neurons", 2, 2, ["L1N2"], 1, 3)  # L1N2, L0G0, L1G0
    priors = {"t": {"neurons": np.array([[10.0, 11, 12, 13, 14, -15]])}}
    values = column_prior(priors, columns, 2, 3)["t"]
    assert values[0, 0] == -15 and np.isinf(values[0, 1:]).all() and (values[0, 1:] > 0).all()
    from lm_eval_headloc.method.confirm import PRIOR_EASE, prior_rankings, prior_weights

    assert prior_rankings(values)[0][0] == 0  # the candidate first, the groups after it
    # The candidate's penalty eased as the largest harm's; the groups' left as it is.
    assert prior_weights(values).tolist() == [1 / (1 + PRIOR_EASE), 1.0, 1.0]


@pytest.fixture(scope="module")
def group_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("groups") / "run"
    args = neuron_args(tiny_model_dir("llama"), "--components", "neurons",
                       "--candidates", "6", "--neuron-groups", "2",
                       "--never-ablate", NEVER)
    assert harness(*args, "--out", str(out)) == 0
    return out, args


#: The group run's --never-ablate: neurons no mask may knock out.
NEVER = "L0N35+L0N44+L1N3"  # L0N35, L0N44: among the prior's first 6


def test_a_group_run_knocks_out_whole_groups(group_run):
    out, _ = group_run
    config = strict_json(out / "config.json")
    assert config["spec"]["neuron_groups"] == 2
    assert config["never_neurons"] == NEVER.split("+")
    design = np.load(out / "design_matrix.npy")
    assert design.shape == (10, 6 + 2 * 2)
    # The expected knockouts, from the candidates and --never-ablate alone: each layer's
    # other neurons cut in two halves in index order.
    never = parse_components(NEVER)
    assert not set(never) & set(parse_components(config["candidates"]))
    taken = {}
    for c in [*parse_components(config["candidates"]), *never]:
        taken.setdefault(c.layer, set()).add(c.neuron)
    groups = []
    for layer in range(2):
        rest = [n for n in range(64) if n not in taken.get(layer, set())]
        half = (len(rest) + 1) // 2
        groups += [[Neuron(layer, n) for n in rest[:half]],
                   [Neuron(layer, n) for n in rest[half:]]]
    candidates = sorted(parse_components(config["candidates"]))
    records, heads = read_run(out)
    by_key = {r["key"]: r for r in records}
    for key, row in zip(config["row_keys"], design, strict=True):
        expected = [c for i, on in enumerate(row) if on
                    for c in ([candidates[i]] if i < 6 else groups[i - 6])]
        assert parse_components(by_key[key]["mask"]) == sorted(expected)
    entries = {e.get("group", e.get("neuron")): e for e in heads["heads"]}
    assert len(entries) == 10
    for i, name in enumerate(["L0G0", "L0G1", "L1G0", "L1G1"]):
        assert entries[name]["size"] == len(groups[i])
        assert parse_components(entries[name]["neurons"]) == groups[i]
    csv = (out / "heads.csv").read_text()
    assert ",L0G1,neuron group,0,1," in csv
    report = (out / "report.md").read_text()
    assert "groups (--neuron-groups 2 per layer" in report
    # The certificate is over the design's columns: 6 candidates and 4 groups of the
    # layers' other neurons (every one of the 128 but the candidates and the never-ablated);
    # none is left unsearched.
    grouped = sum(len(g) for g in groups)
    assert grouped == 2 * 64 - 6 - len(never)
    assert (f"over the 10 components the design searched: the prior's 6 likeliest MLP "
            f"neurons, {grouped} more in groups") in report
    # It counts them as components, each group one ("every one of the 10 neurons
    # checked" counted the 4 groups of the layers' other neurons as neurons).
    assert ("### Certified: every one of the 10 components checked" in report
            or re.search(r"^### Not certified: \d+ of 10 components unchecked$", report, re.M))
    assert "10 neurons" not in report
    # No measurement knocked out a never-ablated neuron (the confirmation's included).
    assert all(not set(parse_components(r["mask"])) & set(never)
               for r in records if r["mask"])


def test_never_ablated_neurons_are_no_candidates(group_run):
    out, _ = group_run
    config = strict_json(out / "config.json")
    prior = json.loads((out / "prior.json").read_text())
    estimates = {t: np.array([p["neuron_effects"] for p in e["points"]])
                 for t, e in prior["tasks"].items()}
    never = parse_components(NEVER)
    # NEVER holds neurons the prior would have given columns: the run skipped them.
    assert set(never) & set(neuron_candidates(estimates, 64, 6))
    assert sorted(parse_components(config["candidates"])) == sorted(
        neuron_candidates(estimates, 64, 6, skip=never))


def test_a_groups_entry_is_one_entry_of_an_ablate_file(group_run, tiny_model_dir, tmp_path):
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    out, _ = group_run
    heads = strict_json(out / "heads.json")
    group = next(e for e in heads["heads"] if "group" in e)
    first = [e for e in heads["heads"] if e is not group][0]
    ranked = tmp_path / "ranked.json"
    ranked.write_text(json.dumps({"heads": [group, first]}))
    lm = HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), device="cpu",
                        dtype="float32", ablate_file=str(ranked), ablate_top=1)
    assert [str(c) for c in lm.knocked_out] == group["neurons"].split("+")


def test_verify_knocks_out_a_groups_neurons(group_run, tmp_path):
    out, _ = group_run
    heads = strict_json(out / "heads.json")
    # Put a group first, as a run where the masks implicate one would (ranks and top-k
    # as the writer would give them: verify refuses a file out of its own order).
    group = next(e for e in heads["heads"] if "group" in e)
    heads["heads"] = [group] + [e for e in heads["heads"] if e is not group]
    for rank, entry in enumerate(heads["heads"], start=1):
        entry["rank"] = rank
    heads["top_k"] = [e.get("group", e.get("neuron")) for e in heads["heads"]][:3]
    ranking = out / "heads-tiny_copy.json"
    written = ranking.read_bytes()
    ranking.write_text(json.dumps(heads))
    try:
        assert harness("verify", str(out), "--top-k", "2", "--random-draws", "1",
                       "--general", "tiny_choice", "--limit", "6") == 0
    finally:  # the shared run as the other tests find it (it was deleted)
        ranking.write_bytes(written)
    records = {r["key"]: r for r in read_run_lines(out / "verify")}
    top1 = parse_components(records["tiny_copy-top1"]["mask"])
    assert top1 == parse_components(group["neurons"])
    top2 = parse_components(records["tiny_copy-top2"]["mask"])
    assert len(top2) == len(top1) + 1
    # The random baseline draws as many neurons as the top-2 knocks out, none of them.
    drawn = parse_components(records["tiny_copy-random1"]["mask"])
    assert len(drawn) == len(top2) and not set(drawn) & set(top2)
    table = (out / "verify" / "verify.md").read_text()
    first, last = group["neurons"].split("+")[0], group["neurons"].split("+")[-1]
    assert f"| 1 | {first}…{last} ({group['size']} neurons) |" in table


def test_groups_need_neurons(tiny_model_dir, tmp_path, capsys):
    code = harness(*neuron_args(tiny_model_dir("llama"), "--neuron-groups", "2"),
                   "--out", str(tmp_path / "bad"))
    assert code == 2
    assert_names(capsys.readouterr().err, "--neuron-groups 2", "--components neurons")
    code = harness(*neuron_args(tiny_model_dir("llama"), "--components", "neurons",
                                "--neuron-groups", "65"), "--out", str(tmp_path / "bad2"))
    assert code == 2
    assert_names(capsys.readouterr().err, "--neuron-groups 65", "64 neurons")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad2").exists()


@pytest.mark.parametrize("which", ["neuron_run", "group_run"])
def test_a_neuron_runs_rankings_read_back_to_the_files_they_were_written_as(which, request):
    from lm_eval_headloc.method.ranking import ranked_heads_json
    from lm_eval_headloc.runs.record import read_rankings

    out, _ = request.getfixturevalue(which)
    rankings = read_rankings(out)
    top_k = json.loads((out / "config.json").read_text())["spec"]["top_k"]
    for task, ranking in rankings.items():
        written = json.loads((out / f"heads-{task}.json").read_text())
        assert json.loads(json.dumps(ranked_heads_json(ranking, top_k))) == written


def test_a_neuron_runs_report_speaks_of_neurons(neuron_run):
    """The prior's and the confirmation's sentences, and heads.json's method, said
    'heads' for a neuron run."""
    from types import SimpleNamespace

    from lm_eval_headloc.report.locate_report import _prior_words

    out, _ = neuron_run
    report = (out / "report.md").read_text()
    assert "the measured MLP neurons' changes held fixed" in report
    assert "then the MLP neurons the fit implicates" in report
    assert "heads' changes" not in report and "the heads the fit" not in report
    method = strict_json(out / "heads.json")["method"]
    assert method.endswith(", the likeliest MLP neurons measured alone"), method
    # Its certificate is over its 16 candidates: the model's other 2 x 64 - 16 neurons
    # were not searched, and the report says so. (The module's run has one neuron
    # --exclude'd by test_a_rerun_measures_nothing_and_refit_reads_it when that runs
    # first: what the run ranks is then one fewer.)
    left_out = len(strict_json(out / "heads.json").get("excluded") or [])
    over = ("the 16 components the design searched" if not left_out else
            f"the {16 - left_out} components the run ranks, of the 16 the design searched "
            f"({left_out} left out of the ranking)")
    assert (f"over {over}: the prior's 16 likeliest MLP neurons. The model's other 112 "
            "neurons were not searched") in report
    path = _prior_words(SimpleNamespace(prior_kind="atp-path",
                                        spec=SimpleNamespace(components="neurons")))
    assert path.endswith("with every neuron half ablated, each ranking the MLP neurons")


def test_an_excluded_neuron_leaves_its_group_out_of_the_ranking(group_run, tmp_path):
    """--exclude of a neuron inside a group left the group ranked: ablate_file=, verify and
    cross knocked the "excluded" neuron out with it, and `refit --exclude L1N20` changed
    nothing."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(group_run[0], out)
    entries = {e.get("group", e.get("neuron")): e for e in strict_json(out / "heads.json")
               ["heads"]}
    inside = parse_components(entries["L1G0"]["neurons"])[3]  # a neuron of L1G0 only
    assert harness("refit", str(out), "--exclude", str(inside)) == 0
    heads = strict_json(out / "heads.json")
    assert heads["excluded"] == ["L1G0"]
    assert "L1G0" not in heads["top_k"]
    ranked = {e.get("group", e.get("neuron")): e for e in heads["heads"]}
    assert "L1G0" not in ranked  # left out, as an excluded neuron is
    assert all(ranked[name]["effect"] is not None for name in ("L0G0", "L0G1", "L1G1"))
    assert (f"- excluded from the ranking: {inside} (and the neuron groups holding one of "
            f"them: L1G0 ({len(entries['L1G0']['neurons'].split('+')):,} neurons))"
            in (out / "report.md").read_text())
    # The certificate covers what the run ranks: its count and the scope line's agree
    # ("every one of the 9 components checked" beside "over the 10 ... searched").
    report = (out / "report.md").read_text()
    total = re.search(r"^### (?:Certified: every one of the (\d+)|Not certified: \d+ of "
                      r"(\d+)) components", report, re.M)
    assert "9" in total.groups()
    assert ("over the 9 components the run ranks, of the 10 the design searched (1 left "
            "out of the ranking)") in report
    # A whole layer's neurons: both its groups, and the candidates of that layer.
    assert harness("refit", str(out), "--exclude", "L1N*") == 0
    excluded = strict_json(out / "heads.json")["excluded"]
    assert {"L1G0", "L1G1"} <= set(excluded)
    assert all(name.startswith("L1") for name in excluded)


def test_the_terminal_says_a_neuron_certificate_covers_only_what_was_searched(
        neuron_run, tmp_path, capsys):
    """The terminal said "certified: 8 measured alone" of a run that searched 8 of 128
    neurons; report.md said the rest was not searched, the terminal did not."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(neuron_run[0], out)
    config = strict_json(out / "config.json")
    searched = len(config["candidates"])
    rest = config["layers"] * config["neurons_per_layer"] - searched
    capsys.readouterr()
    assert harness("refit", str(out)) == 0  # prints as locate does, without the model
    line = next(line for line in capsys.readouterr().out.splitlines()
                if "certified" in line)
    assert (f"certified (of the {searched} components searched; the model's other {rest} "
            "neurons were not): ") in line
