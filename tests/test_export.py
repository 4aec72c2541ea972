"""``lm_eval_headloc.report.mib``: a run's head ranking as MIB's node-level importance file.

The expected files are written out by hand here from MIB's format (EAP-IG's
``Graph.to_json`` / ``Graph.from_json`` at hannamw/EAP-IG@7af394a5662d, the submodule of
hannamw/MIB-circuit-track@b759df34433c), and ``check_mib`` is tried on a fixture laid out
as that code writes one (``tests/fixtures/mib/README.md``) and on broken copies of it.
No model is loaded.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    RANKED,
    RANKED_HEADS_PER_LAYER,
    assert_names,
    capped_fall,
    raises_naming,
    ranking,
    without_waiting_on,
)

from lm_eval_headloc.common.errors import UserError
from lm_eval_headloc.report.mib import MARKER, MIB_MODELS, mib_graph, write_mib
from lm_eval_headloc.report.mib_format import (
    ExportError,
    MibFormatError,
    check_mib,
    is_mib_edge,
    mib_node_names,
    read_mib,
)

FIXTURE = Path(__file__).parent / "fixtures" / "mib" / "node_importances_2x3.json"
# helpers.ranking(): a heads-<task>.json of a 2-layer x 3-head model ranking RANKED (L0H2
# has no effect; L1H2 is left out, as --exclude leaves it).
LAYERS, HEADS, WIDTH = 2, RANKED_HEADS_PER_LAYER, 8


def make_run(folder: Path, *, command: str = "locate", tasks: tuple[str, ...] = ("toy",),
             components: str = "heads", ranked: bool = True,
             model_args: str = "pretrained=/nowhere,dtype=float32,device=cpu") -> Path:
    """A finished-looking run folder written by hand: config.json and heads-<task>.json."""
    from lm_eval_headloc.runs.spec import RunSpec

    spec = RunSpec(model_args=model_args, tasks=tasks, components=components)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "schema": 1, "command": command, "identity": spec.identity("locate"),
        "settings": spec.settings("locate"), "spec": spec.as_config(),
        "layers": LAYERS, "heads_per_layer": HEADS}))
    if ranked:
        for task in tasks:
            name = task.split(":")[0]
            (folder / f"heads-{name}.json").write_text(json.dumps(ranking(name)))
    return folder


def export(run: Path, out: Path, task: str | None = None, **options) -> dict:
    options = {"d_model": WIDTH, "parallel_attn_mlp": False, **options}
    assert write_mib(run, out, task, **options) == out
    return json.loads(out.read_text())


def one_line_error(error: pytest.ExceptionInfo) -> str:
    assert isinstance(error.value, UserError)
    message = str(error.value)
    assert "\n" not in message
    return message


# --- the export, checked against hand-written expectations --------------------------------

def test_export_scores_every_head_with_mibs_sign(tmp_path):
    data = export(make_run(tmp_path / "run"), tmp_path / "mib" / "toy_m" / "importances.json")
    # Higher is better: score = -effect (the fall of the score on knockout). Written out:
    assert data["nodes"] == {
        "input": {"in_graph": False},
        "a0.h0": {"in_graph": False, "score": 0.5},
        "a0.h1": {"in_graph": False, "score": -0.25},
        "a0.h2": {"in_graph": False},  # effect null: unscored
        "m0": {"in_graph": False},  # never knocked out: unscored
        "a1.h0": {"in_graph": False, "score": 0.125},
        "a1.h1": {"in_graph": False, "score": 0.0},
        "a1.h2": {"in_graph": False},  # not in the ranking: unscored
        "m1": {"in_graph": False},
        "logits": {"in_graph": True},
    }
    # Graph.from_model's node order, as Graph.to_json writes it.
    assert list(data["nodes"]) == ["input", "a0.h0", "a0.h1", "a0.h2", "m0", "a1.h0",
                                   "a1.h1", "a1.h2", "m1", "logits"]
    assert data["cfg"] == {"n_layers": 2, "n_heads": 3, "parallel_attn_mlp": False,
                           "d_model": 8}
    assert data["edges"] == {}
    marker = data[MARKER]
    assert marker["made_by"] == "lm-eval-headloc" and marker["task"] == "toy"
    assert marker["unscored_heads"] == ["L0H2", "L1H2"]
    assert marker["higher_is_better"] is True and marker["run"]["command"] == "locate"
    # What the ranking says of its evidence travels with the scores (MIB orders equal
    # scores its own way, and L1H0's 0.125 is within L0H1's help of 0.25).
    assert marker["evidence"] == {
        "tied_with_above": [], "same_masks": {}, "confirmed": ["L0H0", "L1H0", "L1H1", "L0H1"],
        "largest_single_help": {"head": "L0H1", "change": 0.25}}
    # Every fall differs: no score was moved and none is shared.
    assert marker["order"]["tie_broken_by"] == {} and marker["order"]["ties"] == []
    assert "tied_with_above" in marker["evidence_words"]
    check_mib(data)


def test_mibs_ranking_of_the_export_is_the_runs_ranking(tmp_path):
    """MIB's CPR keeps the top n scored nodes by signed score, highest first
    (apply_topn(level="node", absolute=False)): that order must be the run's own, most
    harmful first, for a score that points either way."""
    for higher in (True, False):
        entries = [{"head": name, "effect": None if effect is None else
                    (effect if higher else -effect)} for name, effect in RANKED]
        graph = mib_graph(ranking(higher_is_better=higher, entries=entries),
                          n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)
        scored = [(name, node["score"]) for name, node in graph["nodes"].items()
                  if "score" in node]
        by_mib = [name for name, _ in sorted(scored, key=lambda item: -item[1])]
        assert by_mib == ["a0.h0", "a1.h0", "a1.h1", "a0.h1"]


def test_lower_is_better_keeps_the_sign_and_writes_no_negative_zero(tmp_path):
    graph = mib_graph(ranking(higher_is_better=False), n_layers=LAYERS, n_heads=HEADS,
                      d_model=WIDTH)
    # Lower is better: a positive effect hurts, so score = +effect.
    assert {name: node.get("score") for name, node in graph["nodes"].items()
            if name.startswith("a")} == {"a0.h0": -0.5, "a0.h1": 0.25, "a0.h2": None,
                                         "a1.h0": -0.125, "a1.h1": 0.0, "a1.h2": None}
    higher = mib_graph(ranking(), n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)
    assert "-0.0" not in json.dumps(higher)  # -(0.0) is written as 0.0


def test_a_second_export_replaces_our_own_file(tmp_path):
    run, out = make_run(tmp_path / "run"), tmp_path / "importances.json"
    export(run, out)
    (run / "heads-toy.json").write_text(json.dumps(ranking(higher_is_better=False)))
    assert export(run, out)["nodes"]["a0.h0"]["score"] == -0.5


def test_a_greedy_run_and_a_task_of_several(tmp_path):
    run = make_run(tmp_path / "run", command="greedy", tasks=("toy", "other:acc"))
    data = export(run, tmp_path / "other.json", task="other")
    assert data[MARKER]["task"] == "other" and data[MARKER]["run"]["command"] == "greedy"


def test_width_and_parallel_blocks_from_the_models_config(tmp_path):
    """Without d_model, the run's model's config gives it (no weights loaded); GPT-NeoX's
    attention and MLP read the same residual stream."""
    for name, config, width, parallel in (
            ("gpt2", {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 3}, 16,
             False),
            ("neox", {"model_type": "gpt_neox", "hidden_size": 24, "num_hidden_layers": 2,
                      "num_attention_heads": 3, "intermediate_size": 48}, 24, True)):
        model = tmp_path / name
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        run = make_run(tmp_path / f"run-{name}", model_args=f"pretrained={model}")
        assert write_mib(run, tmp_path / f"{name}.json") == tmp_path / f"{name}.json"
        data = read_mib(tmp_path / f"{name}.json")
        assert (data["cfg"]["d_model"], data["cfg"]["parallel_attn_mlp"]) == (width, parallel)


def test_a_recorded_trust_remote_code_runs_no_model_code(tmp_path):
    """A run recording no width read its recorded model's config with the record's
    trust_remote_code=True: the model folder's (or a Hub repository's) configuration code
    ran. Refused in one line; --model-args naming it, the user's choice, reads it."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "marked", "auto_map": {"AutoConfig": "configuration_marked.Marked"},
        "n_embd": 16, "n_layer": LAYERS, "n_head": HEADS}))
    (model / "configuration_marked.py").write_text(
        f"open({str(tmp_path / 'marked')!r}, 'w').write('ran')\n"
        "from transformers import GPT2Config\n\n\n"
        "class Marked(GPT2Config):\n    model_type = 'marked'\n")
    run = make_run(tmp_path / "run", model_args=f"pretrained={model},trust_remote_code=True")
    with raises_naming(ExportError, "trust_remote_code=True", "--model-args") as error:
        write_mib(run, tmp_path / "x.json")
    one_line_error(error)
    assert not (tmp_path / "marked").exists() and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("model", sorted(MIB_MODELS))
def test_mib_model_fills_the_width_and_checks_the_shape(tmp_path, model):
    with pytest.raises(ExportError) as err:
        write_mib(make_run(tmp_path / "run"), tmp_path / "out.json", mib_model=model)
    layers, heads, _ = MIB_MODELS[model]
    assert_names(one_line_error(err), f"{LAYERS} layers of {HEADS} heads", model,
                 f"{layers} of {heads}")


# --- equal falls: ordered by the run's further evidence ------------------------------------

def evidenced(higher_is_better: bool = True, tied_prior: bool = False) -> dict:
    """A ranking whose falls tie: two heads measured alone that lost 0.5 (told apart by
    the log-likelihood they lost), three the fit left at 0 (by the masks' marginal
    contrast, then the prior), one measured to help."""
    sign = 1 if higher_is_better else -1  # the score's sign; log-likelihoods keep theirs
    rows = [("L0H0", -0.5, {"logprob_change": -1.0, "measured_alone": True}),
            ("L0H1", -0.5, {"logprob_change": -2.0, "measured_alone": True}),
            ("L0H2", 0.0, {"contrast": -0.02, "prior": [-0.3]}),
            ("L1H0", 0.0, {"contrast": 0.01, "prior": [-0.1]}),
            ("L1H1", 0.0, {"contrast": -0.02, "prior": [-0.3 if tied_prior else -0.1]}),
            ("L1H2", 0.25, {"logprob_change": 0.5, "measured_alone": True})]
    entries = [{"head": name, "effect": sign * effect,
                **{key: sign * value if key == "contrast" else value
                   for key, value in fields.items()}} for name, effect, fields in rows]
    return ranking(higher_is_better=higher_is_better, entries=entries)


def head_scores(graph: dict) -> dict[str, float]:
    return {f"L{name[1]}H{name[4]}": node["score"] for name, node in graph["nodes"].items()
            if "score" in node}


#: float32's smallest step above 0 (a subnormal): 2**-149.
TINY = 2.0 ** -149


@pytest.mark.parametrize("higher", [True, False])
def test_equal_falls_are_told_apart_by_the_next_evidence(higher):
    graph = mib_graph(evidenced(higher), n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)
    # By hand. Falls: 0.5 (L0H0, L0H1), 0 (L0H2, L1H0, L1H1), -0.25 (L1H2).
    # At 0.5 both were measured alone: the one whose log-likelihood fell less (1, L0H0)
    # keeps 0.5; L0H1 (2) is one float32 step above it (0.5 = 2**-1: a step is 2**-24).
    # At 0 none was measured. Contrast falls (higher is better: -contrast): .02 (L0H2,
    # L1H1), -.01 (L1H0); then the prior's falls: .3 (L0H2), .1 (L1H1). From 0, one float32
    # step a head: L1H1 1, L0H2 2 above; L1H0 1 below.
    expected = {"L0H0": 0.5, "L0H1": 0.5 + 2.0 ** -24, "L0H2": 2 * TINY, "L1H0": -TINY,
                "L1H1": TINY, "L1H2": -0.25}
    scores = head_scores(json.loads(json.dumps(graph)))  # as the file holds them
    assert scores == expected
    assert {name: float(np.float32(score)) for name, score in scores.items()} == expected
    order = graph[MARKER]["order"]
    # L0H0 kept its measured fall: only L0H1 was moved by the log-likelihood.
    assert order["tie_broken_by"] == {"logprob_change": ["L0H1"],
                                      "contrast": ["L0H2", "L1H0", "L1H1"],
                                      "prior": ["L0H2", "L1H1"]}
    assert order["ties"] == [] and order["made_room"] == []
    assert len(order["by"]) == 4 and "prior" in order["by"][-1]
    check_mib(graph)


def test_heads_equal_in_all_evidence_share_a_score_and_the_file_says_so():
    graph = mib_graph(evidenced(tied_prior=True), n_layers=LAYERS, n_heads=HEADS,
                      d_model=WIDTH)
    scores = head_scores(graph)
    # L0H2 and L1H1: contrast .02 and prior .3 both; one float32 step above 0 together.
    assert scores["L0H2"] == scores["L1H1"] == TINY and scores["L1H0"] == -TINY
    assert len(set(scores.values())) == 5
    assert graph[MARKER]["order"]["ties"] == [{
        "heads": ["L0H2", "L1H1"], "score": TINY,
        "why": "the same fitted effect, marginal contrast and prior estimates"}]
    # Without a prior or anything else recorded, the file says what it lacks.
    bare = ranking(entries=[{"head": h, "effect": 0.0} for h in ("L0H0", "L0H1")])
    ties = mib_graph(bare, n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)[MARKER]["order"]
    assert ties["ties"][0]["heads"] == ["L0H0", "L0H1"]
    assert "records nothing else of them" in ties["ties"][0]["why"]


def crowded(higher_is_better: bool = True) -> dict:
    """A 3 x 4 ranking whose tie-breaks float32 would lose: two heads measured alone that
    lost 0.25 (told apart by the log-likelihood they lost); at 0, four estimates (two
    alike in all their evidence) and a measurement; a measured -0.125 and an estimate
    5e-9 under it (a float32 step there is 2**-26, 1.5e-8); an estimated 0.1, alone at its
    fall."""
    sign = 1 if higher_is_better else -1
    rows = [("L0H0", -0.25, {"logprob_change": -1.0}),
            ("L0H1", -0.25, {"logprob_change": -2.0}),
            ("L0H2", 0.125000005, {"contrast": -0.01}),
            ("L0H3", 0.0, {"contrast": -0.02, "prior": [-0.3]}),
            ("L1H0", 0.0, {"contrast": -0.02, "prior": [-0.1]}),
            ("L1H1", 0.0, {"contrast": 0.01, "prior": [-0.1]}),
            ("L1H2", 0.0, {"logprob_change": 0.5}),
            ("L1H3", 0.0, {"contrast": -0.02, "prior": [-0.3]}),
            ("L2H0", 0.125, {"logprob_change": 0.3}),
            ("L2H1", -0.1, {"contrast": -0.05})]
    entries = [{"head": name, "effect": sign * effect,
                "measured_alone": "logprob_change" in fields,
                **{key: sign * value if key == "contrast" else value
                   for key, value in fields.items()}} for name, effect, fields in rows]
    data = ranking(higher_is_better=higher_is_better, entries=entries)
    return {**data, "heads_per_layer": 4,
            "confirmed": [e["head"] for e in entries if e["measured_alone"]]}


def export_key(entry: dict, higher: bool, points: int, data: dict | None = None) -> tuple:
    """A ranking entry's evidence as the export orders heads by it, read here from the
    file on its own: its fall (``capped_fall`` where the whole ranking ``data`` is
    given); an estimate's further falls (log-likelihood, contrast,
    prior; 0 where absent), zeros for a head measured alone, which keeps its fall; a
    measurement's further falls, zeros for an estimate; 1 for a measurement, 0 for an
    estimate."""
    sign = -1 if higher else 1
    prior = [*entry.get("prior", []), *[0.0] * (points - len(entry.get("prior", [])))]
    further = (-entry.get("logprob_change", 0.0), sign * entry.get("contrast", 0.0),
               *(-p for p in prior))
    none = (0.0,) * len(further)
    alone = entry.get("measured_alone") is True
    fall = sign * entry["effect"] if data is None else capped_fall(entry, data)
    return (fall, *(none if alone else further), *(further if alone else none),
            1.0 if alone else 0.0)


def assert_float32_keeps_the_order(data: dict, scores: dict[str, float],
                                   ties: list[dict]) -> None:
    """Read as MIB reads them (float32), the scores order the heads as their evidence does
    (``export_key``): higher where it is larger, equal exactly where it is equal; and the
    export's record of its ties is those equal scores."""
    higher = data["higher_is_better"]
    points = max(len(e.get("prior", [])) for e in data["heads"])
    keys = {e["head"]: export_key(e, higher, points, data) for e in data["heads"]
            if e["effect"] is not None}
    as_read = {name: np.float32(score) for name, score in scores.items()}
    assert as_read.keys() == keys.keys()
    for a in keys:
        for b in keys:
            assert (keys[a] > keys[b]) == (as_read[a] > as_read[b]), (a, b)
            assert (keys[a] == keys[b]) == (as_read[a] == as_read[b]), (a, b)
    groups: dict[tuple, list[str]] = {}
    for name, key in keys.items():
        groups.setdefault(key, []).append(name)
    assert (sorted(sorted(t["heads"]) for t in ties)
            == sorted(sorted(g) for g in groups.values() if len(g) > 1))
    for tie in ties:
        assert {as_read[name] for name in tie["heads"]} == {np.float32(tie["score"])}


@pytest.mark.parametrize("higher", [True, False])
def test_tie_breaks_survive_float32_and_measured_falls_stay(higher):
    """Tie-breaks of a fraction of the gap to the next score (1e-19 on a default run)
    vanished when MIB loaded the scores as float32, and the file's own list of ties was
    not what MIB saw; heads measured alone were moved off what they measured (L1H4 0.2083
    where it measured 0.1875)."""
    data = crowded(higher)
    graph = json.loads(json.dumps(mib_graph(data, n_layers=3, n_heads=4, d_model=WIDTH)))
    scores = head_scores(graph)
    order = graph[MARKER]["order"]
    assert_float32_keeps_the_order(data, scores, order["ties"])
    # A measured head's score is its measured fall, exactly: alone at its fall (L2H0), the
    # only measurement of its fall (L1H2), the one of two nearest to no further evidence
    # (L0H0). L0H1, which the log-likelihood tells from it, is one float32 step above.
    assert (scores["L0H0"], scores["L1H2"], scores["L2H0"]) == (0.25, 0.0, -0.125)
    assert scores["L0H1"] == 0.25 + 2.0 ** -25
    # An estimate alone at its fall keeps it; L0H2's -0.125000005 reads as -0.125 in
    # float32, so it makes room, one step under L2H0: the estimate moves, not the
    # measurement. No estimate is above a harm measured alone: nothing is capped.
    assert scores["L2H1"] == 0.1
    assert scores["L0H2"] == -0.125 - 2.0 ** -26 and order["made_room"] == ["L0H2"]
    assert order["capped"] == {}
    # At 0: the estimates step from the measurement by contrast, then prior; the sign is
    # their contrast's.
    assert (scores["L0H3"], scores["L1H3"], scores["L1H0"], scores["L1H1"]) == (
        2 * TINY, 2 * TINY, TINY, -TINY)
    assert order["ties"] == [{"heads": ["L0H3", "L1H3"], "score": 2 * TINY,
                              "why": "the same fitted effect, marginal contrast and "
                                     "prior estimates"}]
    assert order["tie_broken_by"] == {"logprob_change": ["L0H1"],
                                      "contrast": ["L0H3", "L1H0", "L1H1", "L1H3"],
                                      "prior": ["L0H3", "L1H0", "L1H3"]}
    check_mib(graph)


def test_evidence_that_is_not_a_number_is_refused():
    for field, value in (("contrast", "x"), ("logprob_change", math.inf), ("prior", [0, None]),
                         ("prior", 0.5)):
        data = evidenced()
        data["heads"][2][field] = value
        with pytest.raises(ExportError) as err:
            mib_graph(data, n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)
        assert_names(one_line_error(err), "L0H2", field)


def test_an_effect_past_float32_is_refused_without_a_warning():
    """A forged effect of 1e308 was written (MIB reads it as inf) after two numpy overflow
    warnings."""
    import warnings

    for value in (1e308, -1e39):
        data = evidenced()
        data["heads"][2]["effect"] = value
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ExportError) as err:
                mib_graph(data, n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)
        assert_names(one_line_error(err), "L0H2", repr(value), "float32")




@pytest.mark.parametrize("name", [
    "headloc_ioi/stratified-p0.1-atp-path/m40-seed2",  # the prior and 24 heads alone
    "headloc_induction/stratified-p0.02/seed0",  # no prior, nothing measured alone
])
def test_a_committed_lasso_run_orders_every_head(name, tmp_path, committed_benchmarks):
    """The export of a Lasso run gave 229 of 270 heads the score 0.0. Every head
    must be ordered by the run's evidence; heads share a score only where all of it is
    equal, and the file lists them."""
    run = committed_benchmarks / "recovery-runs" / name
    task = name.split("/")[0]
    data = json.loads((run / f"heads-{task}.json").read_text())
    higher = data["higher_is_better"]
    graph = json.loads(write_mib(run, tmp_path / "x.json", d_model=576,
                                 parallel_attn_mlp=False).read_text())
    scores = head_scores_wide(graph)
    points = max(len(e.get("prior", [])) for e in data["heads"])
    evidence = {e["head"]: export_key(e, higher, points, data) for e in data["heads"]}
    assert len(scores) == len(evidence) == 270
    # Ordered as the evidence, level by level, as MIB reads the scores (float32); equal
    # scores are exactly the groups of equal evidence, and the file names them.
    ties = graph[MARKER]["order"]["ties"]
    assert_float32_keeps_the_order(data, scores, ties)
    groups: dict[tuple, list[str]] = {}
    for head in (e["head"] for e in data["heads"]):
        groups.setdefault(evidence[head], []).append(head)
    tied = sorted(sorted(g) for g in groups.values() if len(g) > 1)
    assert len({np.float32(s) for s in scores.values()}) == 270 - sum(len(g) - 1 for g in tied)
    # A head measured alone, the only one measured to its fall, scores that fall exactly.
    measured = [e for e in data["heads"] if e.get("measured_alone")]
    assert all(scores[e["head"]] == (-1 if higher else 1) * e["effect"] for e in measured
               if sum(m["effect"] == e["effect"] for m in measured) == 1)
    if "prior" in data["heads"][0]:  # every head has its own estimates: nothing ties
        assert tied == [] and len({tuple(e["prior"]) for e in data["heads"]}) == 270
    else:
        assert tied and all("no prior" in t["why"] for t in ties)
    assert sum(s == 0.0 for s in scores.values()) <= 1 + sum(len(g) for g in tied)


def head_scores_wide(graph: dict) -> dict[str, float]:
    """Head node name a{l}.h{h} -> its score, as L{l}H{h}, for any number of layers."""
    out = {}
    for name, node in graph["nodes"].items():
        if name.startswith("a") and "score" in node:
            layer, head = name[1:].split(".h")
            out[f"L{layer}H{head}"] = node["score"]
    return out


# --- refusals -------------------------------------------------------------------------------

def test_refuses_a_task_the_run_does_not_have(tmp_path):
    run = make_run(tmp_path / "run", tasks=("toy", "other"))
    with pytest.raises(ExportError) as err:
        export(run, tmp_path / "out.json", task="nope")
    assert_names(one_line_error(err), "'nope'", "toy, other")
    with pytest.raises(ExportError) as err:  # two tasks: which one must be said
        export(run, tmp_path / "out.json")
    assert_names(one_line_error(err), str(run), "(toy, other)")
    assert not (tmp_path / "out.json").exists()


def test_never_overwrites_a_file_that_is_not_ours(tmp_path):
    run, out = make_run(tmp_path / "run"), tmp_path / "importances.json"
    for text in ('{"cfg": {}, "nodes": {}, "edges": {}}', "not json",
                 '{"headloc_export": {"made_by": "someone else"}}'):
        out.write_text(text)
        with pytest.raises(ExportError) as err:
            export(run, out)
        assert_names(one_line_error(err), f"{out} exists", "lm-eval-headloc")
        assert out.read_text() == text


def test_refuses_a_run_that_ranks_neurons(tmp_path):
    run = make_run(tmp_path / "run", components="heads+neurons")
    with pytest.raises(ExportError) as err:
        export(run, tmp_path / "out.json")
    assert_names(one_line_error(err), str(run), "heads+neurons")
    for entry, name in (({"neuron": "L1N5", "effect": -0.1}, "L1N5"),
                        ({"group": "L1G0", "neurons": "L1N0+L1N1", "effect": -0.1}, "L1G0")):
        with pytest.raises(ExportError) as err:
            mib_graph(ranking(entries=[{"head": "L0H0", "effect": -0.2}, entry]),
                      n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)
        assert_names(one_line_error(err), f"holds {name}")


@pytest.mark.parametrize("command", ["verify", "cross", "sweep"])
def test_refuses_a_run_that_is_no_ranking(tmp_path, command):
    with pytest.raises(ExportError) as err:
        export(make_run(tmp_path / "run", command=command), tmp_path / "out.json")
    assert_names(one_line_error(err), str(tmp_path / "run"), f"a {command} run")


def test_refuses_bad_outputs_and_unfinished_runs(tmp_path):
    run = make_run(tmp_path / "run")
    # Each names the output given and what to write instead (or the run it is inside).
    for out, allowed in ((tmp_path / "out.pt", ".json"),
                         (tmp_path, str(tmp_path / "importances.json")),
                         (run / "mib.json", f"folder {run}")):
        with pytest.raises(ExportError) as err:
            export(run, out)
        assert_names(one_line_error(err), str(out), allowed)
    with pytest.raises(ExportError) as err:
        export(make_run(tmp_path / "unranked", ranked=False), tmp_path / "out.json")
    assert_names(one_line_error(err), str(tmp_path / "unranked"), "heads-toy.json")
    with pytest.raises(UserError):  # not a run folder at all
        export(tmp_path / "nowhere", tmp_path / "out.json")


def test_options_of_the_wrong_kind_are_refused_not_taken_as_true(tmp_path):
    """parallel_attn_mlp="no" exported a graph of parallel blocks (bool("no")); a
    model_args that is not a string was an AttributeError."""
    run = make_run(tmp_path / "run")
    for options, named in (({"parallel_attn_mlp": "no"}, "parallel_attn_mlp='no'"),
                           ({"parallel_attn_mlp": "no", "mib_model": "gpt2"},
                            "parallel_attn_mlp='no'"),
                           ({"d_model": None, "model_args": 5}, "model_args=5")):
        with pytest.raises(ExportError) as err:
            export(run, tmp_path / "out.json", **options)
        assert_names(one_line_error(err), named)
    assert not (tmp_path / "out.json").exists()


def test_refuses_rankings_that_do_not_fit_the_model():
    # Each names the value the ranking holds and, where there is one, what the model allows.
    cases = [
        (ranking(entries=[{"head": "L2H0", "effect": -0.1}]), ("'L2H0'", f"0..{LAYERS - 1}")),
        (ranking(entries=[{"head": "L0H0", "effect": -0.1}] * 2), ("head L0H0",)),
        (ranking(entries=[{"head": "L0H0", "effect": "big"}]), ("L0H0", "'big'")),
        ({**ranking(), "higher_is_better": None}, ("higher_is_better is None",)),
        ({**ranking(), "heads_per_layer": 4}, ("4 heads per layer", f"model {HEADS}")),
    ]
    for data, values in cases:
        with pytest.raises(ExportError) as err:
            mib_graph(data, n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)
        assert_names(one_line_error(err), *values)


# --- MIB's format: the fixture, broken copies, the graph's edges ---------------------------

def test_the_fixture_in_mibs_own_layout_is_accepted():
    data = read_mib(FIXTURE)
    assert list(data["nodes"]) == mib_node_names(LAYERS, HEADS)
    # Edges of a 2-layer x 3-head sequential graph, by hand: layer 0's heads read input
    # (1 x 3 heads x q/k/v = 9), its MLP input and its 3 heads (4); layer 1's heads read
    # those 5 (45), its MLP 8; the logits all 9.
    assert len(data["edges"]) == 9 + 4 + 45 + 8 + 9
    unscored = copy.deepcopy(data)  # as Graph.to_json writes an unscored node: NaN
    unscored["nodes"]["m0"]["score"] = math.nan
    check_mib(unscored)
    edge_level = copy.deepcopy(data)  # an edge-level file: node entries hold in_graph only
    for node in edge_level["nodes"].values():
        node.pop("score", None)
    check_mib(edge_level, node_scores=False)
    with pytest.raises(MibFormatError, match="no node has a score"):
        check_mib(edge_level)


def _broken(change):
    data = json.loads(FIXTURE.read_text())
    change(data)
    return data


BROKEN = {
    "no d_model": (lambda d: d["cfg"].pop("d_model"), "cfg d_model"),
    "n_heads as text": (lambda d: d["cfg"].update(n_heads="3"), "cfg n_heads"),
    "parallel as 0": (lambda d: d["cfg"].update(parallel_attn_mlp=0), "parallel_attn_mlp"),
    "one layer too few": (lambda d: d["cfg"].update(n_layers=1), "unknown node 'a1.h0'"),
    "missing node": (lambda d: d["nodes"].pop("a1.h2"), "missing, first 'a1.h2'"),
    "zero-padded name": (lambda d: d["nodes"].update({"a01.h0": {"in_graph": True}}),
                         "unknown node 'a01.h0'"),
    "no in_graph": (lambda d: d["nodes"]["m0"].pop("in_graph"), "'in_graph'"),
    "score as text": (lambda d: d["nodes"]["a0.h1"].update(score="1.0"), "score '1.0'"),
    "short neurons": (lambda d: d["nodes"]["m0"].update(neurons=[True] * 7), "8 numbers"),
    "no edges key": (lambda d: d.pop("edges"), "missing key(s) edges"),
    "backward edge": (lambda d: d["edges"].update({"m1->a0.h0<q>": d["edges"]["input->m0"]}),
                      "'m1->a0.h0<q>' is not an edge"),
    "head input unnamed": (lambda d: d["edges"].update({"input->a0.h0": {
        "score": 0.1, "in_graph": False}}), "'input->a0.h0' is not an edge"),
    "edge without score": (lambda d: d["edges"]["input->m0"].pop("score"), "numeric 'score'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_copies_of_the_fixture_are_refused(case):
    change, named = BROKEN[case]
    with pytest.raises(MibFormatError) as err:
        check_mib(_broken(change))
    assert_names(one_line_error(err), named)


def test_a_missing_node_is_what_mibs_loader_itself_lets_pass():
    # Graph.from_json leaves a node missing from the file unscored; only complete=True,
    # which asks for the file Graph.to_json writes, refuses it.
    check_mib(_broken(lambda d: d["nodes"].pop("a1.h2")), complete=False)


def test_read_mib_names_the_file(tmp_path):
    bad = tmp_path / "importances.json"
    bad.write_text(json.dumps(_broken(lambda d: d["cfg"].pop("d_model"))))
    for path, words in ((bad, "cfg d_model"), (tmp_path / "none.json", "no such file"),
                        (FIXTURE.with_suffix(".md"), ".json")):
        with pytest.raises(MibFormatError) as err:
            read_mib(path)
        assert_names(one_line_error(err), str(path), words)


@pytest.mark.parametrize("model", ["gpt2", "gemma2"])
def test_the_graphs_edges_are_as_many_as_mib_counts(model):
    """MIB's evaluation backend lists each model's edge count (gpt2 32491, gemma2 74218):
    counting the (parent, child) pairs ``is_mib_edge`` accepts must give the same."""
    layers, heads, _ = MIB_MODELS[model]
    names = mib_node_names(layers, heads)
    count = 0
    for parent in names:
        for child in names:
            ends = [f"<{q}>" for q in "qkv"] if child.startswith("a") else [""]
            count += sum(is_mib_edge(f"{parent}->{child}{end}", layers, heads)
                         for end in ends)
    assert count == {"gpt2": 32491, "gemma2": 74218}[model]


def test_parallel_blocks_add_no_edge_within_a_layer():
    assert is_mib_edge("a0.h1->m0", 2, 3, parallel_attn_mlp=False)
    assert not is_mib_edge("a0.h1->m0", 2, 3, parallel_attn_mlp=True)
    assert is_mib_edge("m0->a1.h2<v>", 2, 3, parallel_attn_mlp=True)
    assert not is_mib_edge("a0.h0->a0.h1<q>", 2, 3)
    assert not is_mib_edge("logits->m1", 2, 3) and not is_mib_edge("m1->input", 2, 3)


def test_mibs_own_loader_reads_the_export(tmp_path):
    """Where EAP-IG (MIB's graph code) is installed, its Graph.from_json reads the file
    (not on PyPI: it is a submodule of MIB's repository, so usually skipped)."""
    graph_module = pytest.importorskip("eap.graph")
    out = tmp_path / "importances.json"
    export(make_run(tmp_path / "run"), out)
    graph = graph_module.Graph.from_json(str(out))
    assert float(graph.nodes["a0.h0"].score) == 0.5
    assert math.isnan(float(graph.nodes["a0.h2"].score))
    assert graph.cfg["d_model"] == WIDTH


# --- the command line ----------------------------------------------------------------------

def test_the_export_command_writes_what_write_mib_writes(tmp_path, capsys):
    from lm_eval_headloc.cli.main import main

    def harness(*args: str) -> int:
        try:
            return main([*args])
        except SystemExit as exit_:
            return exit_.code

    # The width comes from the run's model's config (no weights are read): a GPT-2 config
    # of the toy run's 2 layers x 3 heads, 12 wide.
    from transformers import GPT2Config

    model = tmp_path / "model"
    GPT2Config(n_layer=LAYERS, n_head=HEADS, n_embd=12).save_pretrained(model)
    run = make_run(tmp_path / "run", model_args=f"pretrained={model}")
    out = tmp_path / "toy_m" / "importances.json"
    assert harness("export", str(run), "--out", str(out)) == 0
    assert f"Written to {out}" in capsys.readouterr().out
    written = read_mib(out)
    assert written["cfg"] == {"n_layers": LAYERS, "n_heads": HEADS, "d_model": 12,
                              "parallel_attn_mlp": False}
    by_hand = export(run, tmp_path / "api.json", d_model=12)
    assert written["nodes"] == by_hand["nodes"]
    # A user's mistake is one line and exit 2, and nothing is written.
    bad = tmp_path / "bad.json"
    assert harness("export", str(run), "--task", "nope", "--out", str(bad)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task 'nope'" in err[0] and not bad.exists()


def test_an_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    from transformers import GPT2Config

    from lm_eval_headloc.cli.main import main

    model = tmp_path / "model"
    GPT2Config(n_layer=LAYERS, n_head=HEADS, n_embd=12).save_pretrained(model)
    run = make_run(tmp_path / "run", model_args=f"pretrained={model}")
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("mine\n")
    # A folder where a file stands: its mkdir fails (a traceback before).
    assert main(["export", str(run), "--out", str(a_file / "importances.json")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(
        f"headloc-harness: error: cannot write {a_file / 'importances.json'}: ")
    assert a_file.read_text() == "mine\n"


def test_a_group_test_that_helped_caps_no_estimate(tmp_path, committed_benchmarks):
    """A group test that helped the task beyond the noise rules out nothing (the
    certificate's rule: a helpful member may hide a harmful one), yet it capped each of its
    unmeasured members at its help: on the induction run 15 heads nobody measured alone
    scored as helping by 0.10, next to the largest help measured alone. Now it caps
    nothing, and a test that did not hurt caps its members at no harm, never at a help."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.95)
    run = committed_benchmarks / "recovery-runs" / "headloc_induction" / "certified" / "seed0"
    data = json.loads((run / "heads-headloc_induction.json").read_text())
    sign = -1 if data["higher_is_better"] else 1
    alone = {e["head"] for e in data["heads"] if e.get("measured_alone")}
    helping = ["+".join(t["components"]) for t in data["certificate"]["group_tests"]
               if sign * t["change"] < -z * t["se"] and set(t["components"]) - alone]
    assert helping  # the case: sets that helped, with members not measured alone
    graph = json.loads(write_mib(run, tmp_path / "x.json", d_model=576,
                                 parallel_attn_mlp=False).read_text())
    capped = graph[MARKER]["order"]["capped"]
    assert not {c["by"].removeprefix("group test ") for c in capped.values()} & set(helping)
    assert all(c["cap"] >= 0 for c in capped.values() if c["by"].startswith("group test"))
    scores = head_scores_wide(graph)
    entry = {e["head"]: e for e in data["heads"]}
    for head, score in scores.items():  # as capped_fall reads the file on its own
        if head not in alone and entry[head]["effect"] is not None:
            assert score == pytest.approx(capped_fall(entry[head], data), abs=1e-6), head


def test_mibs_top_n_is_the_runs_and_a_group_test_caps_an_estimate(tmp_path,
                                                                  committed_benchmarks):
    """A certified run's export scored L17H7 (the fit's estimate, a fall of 0.138) above
    its top head (L1H5, 0.08 measured alone), though the group test that knocked out
    L17H7 with L3H4 changed the score by 0: MIB's top-3 were heads the run had cleared."""
    run = committed_benchmarks / "recovery-runs" / "headloc_ioi" / "certified" / "seed0"
    data = json.loads((run / "heads-headloc_ioi.json").read_text())
    graph = json.loads(write_mib(run, tmp_path / "x.json", d_model=576,
                                 parallel_attn_mlp=False).read_text())
    scores = head_scores_wide(graph)
    by_score = sorted(scores, key=lambda head: -np.float32(scores[head]))
    # The run's top-5 is MIB's, as a set (two of them measured the same fall, 0.05).
    assert set(by_score[:5]) == set(data["top_k"])
    entry = {e["head"]: e for e in data["heads"]}
    [test] = [t for t in data["certificate"]["group_tests"]
              if set(t["components"]) == {"L3H4", "L17H7"}]
    assert test["change"] == 0.0 and -entry["L17H7"]["effect"] > 0.13
    capped = graph[MARKER]["order"]["capped"]
    assert capped["L17H7"] == {"estimate": -entry["L17H7"]["effect"], "cap": 0.0,
                               "by": "group test L3H4+L17H7"}
    assert scores["L17H7"] <= 0.0 + 1e-6
    # No estimate outranks a harm measured alone.
    least = min(-e["effect"] for e in data["heads"]
                if e.get("measured_alone") and -e["effect"] > 0)
    assert all(np.float32(scores[h]) < np.float32(least) for h in scores
               if not entry[h].get("measured_alone"))


def test_estimates_capped_under_the_measured_keep_the_rankings_order(tmp_path,
                                                                    committed_benchmarks):
    """The estimates above the least harm measured alone were all capped to one score just
    under it, then told apart by their marginal contrast: L27H6 (the fit's 0.018, ranked
    29th) was scored above L15H2 (0.093, ranked 24th), so MIB's top-24 was not the run's.
    They keep the ranking's order, by the estimate."""
    run = (committed_benchmarks / "recovery-runs" / "heldout_kv_recall"
           / "stratified-p0.1-atp-path" / "m54-seed0")
    data = json.loads((run / "heads-heldout_kv_recall.json").read_text())
    graph = json.loads(write_mib(run, tmp_path / "x.json").read_text())
    scores = head_scores_wide(graph)
    capped = graph[MARKER]["order"]["capped"]
    by_ranking = [e["head"] for e in data["heads"] if e["effect"] is not None
                  and -e["effect"] > 0]
    assert {"L15H2", "L27H6"} <= {h for h, c in capped.items() if c["by"].startswith(
        "the ranking")}
    by_score = sorted(scores, key=lambda head: -np.float32(scores[head]))
    assert by_score[:len(by_ranking)] == by_ranking


@pytest.mark.parametrize("baseline, said", [(0.0, "whose baseline is 0"), (0.75, "")])
def test_an_export_where_no_knockout_moved_the_task_says_it_ranks_nothing(
        tmp_path, caplog, baseline, said):
    """An all-zero file was written with 'Written to' alone, and reads in MIB as a ranking."""
    import logging

    run = make_run(tmp_path / "run")
    flat = ranking()
    flat["baseline"] = baseline
    for entry in flat["heads"]:
        entry["effect"] = None if entry["effect"] is None else 0.0
    (run / "heads-toy.json").write_text(json.dumps(flat))
    with caplog.at_level(logging.WARNING, logger="lm_eval_headloc.report.mib"):
        graph = export(run, tmp_path / "flat.json")
    assert not any(head_scores(graph).values())
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "every head scores 0 (no knockout moved toy" in warning
    assert ("whose baseline is 0" in warning) == bool(said)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lm_eval_headloc.report.mib"):
        export(make_run(tmp_path / "moved"), tmp_path / "moved.json")  # the usual run
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_helper_measured_alone_lifts_the_cap_of_a_group_test_it_is_in():
    """A group test of L0H1 (measured alone to help: +0.25 where higher is better) and
    L1H2 (an estimated harm of 0.3) fell by only 0.05: L0H1's help hides as much of the
    others' harm, so, as the certificate reads the set, it caps L1H2 at 0.05 + 0.25, not
    at 0.05 (which put it under heads the run never cleared)."""
    entries = [{"head": name, "effect": effect, "measured_alone": effect is not None}
               for name, effect in RANKED] + [
        {"head": "L1H2", "effect": -0.3, "measured_alone": False}]
    data = ranking(entries=entries)
    data["certificate"] = {"group_tests": [
        {"components": ["L0H1", "L1H2"], "change": -0.05, "se": 0.01}]}
    graph = mib_graph(data, n_layers=LAYERS, n_heads=HEADS, d_model=WIDTH)
    capped = graph[MARKER]["order"]["capped"]
    # The group test's own cap (0.05 + 0.25 = 0.30) does not bind; the ranking's does:
    # an estimate stays just under the least harm measured alone (L1H0's 0.125).
    assert capped["L1H2"]["by"].startswith("the ranking"), capped
    assert capped["L1H2"]["cap"] == pytest.approx(0.125, abs=1e-6)
    entry = {e["head"]: e for e in entries}
    assert graph["nodes"]["a1.h2"]["score"] == pytest.approx(
        capped_fall(entry["L1H2"], data), abs=1e-6)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_as_out_is_refused_not_waited_on(tmp_path):
    """A FIFO named as --out hung export for ever (reading it to see whether it is an
    export of ours waits for a writer); refused in one line now."""
    run, out = make_run(tmp_path / "run"), tmp_path / "importances.json"
    os.mkfifo(out)
    error = without_waiting_on(out, lambda: export(run, out))
    assert isinstance(error, ExportError)
    assert_names(str(error), f"{out} is a FIFO, not a regular file")
