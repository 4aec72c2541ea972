"""Head types in the product: ``headloc-harness types`` for a model alone, and every locate
run's types.json carried into heads.json, heads.csv and the report's top-k table. Expected
scores are computed here on a separately loaded copy of the model, from the probe alone."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
import torch
from helpers import harness, raises_naming, strict_json, tiny_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm_eval_headloc.common.options import PROBE_ROWS
from lm_eval_headloc.method.head_types import (
    HEAD_TYPES,
    dominant_type,
    head_type_scores,
    repeated_probe,
)


def probe_scores(model_dir, rows: int = PROBE_ROWS) -> dict[str, np.ndarray]:
    """The probe's scores from a plain transformers copy of the model (no hf-headablate)."""
    return probe_scores_and_errors(model_dir, rows)[0]


def probe_scores_and_errors(model_dir, rows: int = PROBE_ROWS
                            ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The probe's scores and their standard errors, each row scored on its own here."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probe = repeated_probe(model.get_input_embeddings().num_embeddings, length=32,
                           batch=rows, seed=0, first_token=tokenizer.bos_token_id)
    each = [head_type_scores(model, probe[r:r + 1]) for r in range(rows)]
    stacked = {t: np.stack([row[t] for row in each]) for t in HEAD_TYPES}
    return ({t: v.mean(axis=0) for t, v in stacked.items()},
            {t: v.std(axis=0, ddof=1) / np.sqrt(rows) for t, v in stacked.items()})


@pytest.fixture(scope="module")
def typed_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("typed") / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "8", "--masks", "6", "--sparsity", "0.25", "--confirm",
                   "2", "--prior", "atp", "--top-k", "3", "--out", str(out)) == 0
    return out


def test_a_locate_run_carries_every_heads_type_scores(typed_run, tiny_model_dir):
    expected, errors = probe_scores_and_errors(tiny_model_dir("llama"))
    labels = dominant_type(expected, errors=errors)
    stored = strict_json(typed_run / "types.json")
    assert stored["examples"] > 0 and stored["on_examples"] is not None
    heads = strict_json(typed_run / "heads.json")
    assert len(heads["heads"]) == 8  # 2 layers x 4 heads, each with its four scores
    for entry in heads["heads"]:
        layer, head = entry["layer"], entry["head_in_layer"]
        assert set(entry["types"]) == set(HEAD_TYPES)
        for name in HEAD_TYPES:
            assert entry["types"][name] == pytest.approx(expected[name][layer, head],
                                                         abs=1e-6), (entry["head"], name)
        assert entry["type"] == labels[layer][head]
    rows = list(csv.DictReader(io.StringIO((typed_run / "heads.csv").read_text())))
    assert list(rows[0])[-5:] == [*HEAD_TYPES, "type"]
    for row in rows:
        layer, head = int(row["layer"]), int(row["head_in_layer"])
        assert float(row["induction"]) == pytest.approx(expected["induction"][layer, head],
                                                        abs=1e-5)
    report = (typed_run / "report.md").read_text()
    assert "| type (score) |" in report


def test_refit_keeps_the_types_and_a_rerun_computes_nothing(typed_run):
    before = (typed_run / "types.json").read_text()
    assert harness("refit", str(typed_run), "--top-k", "2") == 0
    assert (typed_run / "types.json").read_text() == before
    assert all("types" in e for e in strict_json(typed_run / "heads.json")["heads"])


def test_the_report_labels_a_head_only_where_a_type_stands_out(typed_run):
    from lm_eval_headloc.runs.record import load_run
    from lm_eval_headloc.runs.types_file import read_types

    head_types = read_types(typed_run)
    heads = strict_json(typed_run / "heads.json")
    report = (typed_run / "report.md").read_text()
    for entry in heads["heads"][:2]:
        label = head_types.label(entry["layer"], entry["head_in_layer"])
        cell = "-" if label is None else (
            f"{label.replace('_', '-')} ({entry['types'][label]:.2f})")
        row = next(line for line in report.splitlines()
                   if line.startswith(f"| {entry['rank']} | {entry['head']} |"))
        assert row.endswith(f" {cell} |"), row
    assert load_run(typed_run).command == "locate"


def test_a_head_outside_the_model_is_named_not_wrapped_round(typed_run):
    from lm_eval_headloc.intervention.components import ComponentSpecError
    from lm_eval_headloc.runs.types_file import read_types

    head_types = read_types(typed_run)  # a 2-layer model of 4 heads each
    assert head_types.of(1, 3) == {t: float(head_types.scores[t][1, 3])
                                   for t in head_types.scores}
    for layer, head, values in ((-1, 0, ("layer -1", "0..1")), (2, 0, ("layer 2", "0..1")),
                                (0, -1, ("head -1", "0..3")), (0, 4, ("head 4", "0..3"))):
        for read in (head_types.of, head_types.label):
            with raises_naming(ComponentSpecError, *values):
                read(layer, head)


def test_the_types_command_writes_every_head(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "types"
    args = ["types", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", "--out", str(out)]
    assert harness(*args) == 0
    printed = capsys.readouterr().out
    assert "induction:" in printed and "previous-token:" in printed
    expected = probe_scores(tiny_model_dir("llama"))
    rows = list(csv.DictReader(io.StringIO((out / "types.csv").read_text())))
    assert [r["head"] for r in rows] == [f"L{layer}H{h}" for layer in range(2)
                                         for h in range(4)]
    for row in rows:
        layer, head = int(row["layer"]), int(row["head_in_layer"])
        for name in HEAD_TYPES:
            assert float(row[name]) == pytest.approx(expected[name][layer, head], abs=1e-5)
    assert strict_json(out / "config.json")["command"] == "types"
    stored = (out / "types.json").read_text()
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    with pytest.MonkeyPatch.context() as patched:  # resumed: nothing computed, no model
        patched.setattr(HFHeadAblateLM, "__init__", refuse)
        assert harness(*args) == 0
    assert (out / "types.json").read_text() == stored
    assert json.loads(stored)["probe"]["length"] == 32
    assert json.loads(stored)["probe"]["batch"] == PROBE_ROWS


def test_the_probe_has_as_many_rows_as_asked(tiny_model_dir, tmp_path, capsys):
    """--probe-rows: the probe's size, part of what a types run measured (a rerun with
    another size is refused, not answered from the other probe's file)."""
    out = tmp_path / "types"
    args = ["types", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", "--out", str(out)]
    assert harness(*args, "--probe-rows", "6") == 0
    stored = strict_json(out / "types.json")
    assert stored["probe"]["batch"] == 6
    expected, errors = probe_scores_and_errors(tiny_model_dir("llama"), rows=6)
    for name in HEAD_TYPES:
        np.testing.assert_allclose(np.array(stored["scores"][name], dtype=float),
                                   expected[name], atol=2e-6)
        np.testing.assert_allclose(np.array(stored["errors"][name], dtype=float),
                                   errors[name], atol=2e-6)
    assert stored["dominant"] == dominant_type(expected, errors=errors)
    assert "attention_sink" not in stored["thresholds"]
    capsys.readouterr()
    assert harness(*args, "--probe-rows", "8") == 2
    assert "probe_rows" in capsys.readouterr().err
    assert strict_json(out / "types.json") == stored
    assert harness(*args, "--probe-rows", "1", "--out", str(tmp_path / "one")) == 2
    assert "--probe-rows" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "one").exists()
    # A billion rows (500 GB of token ids) is refused in one line before any weights load.
    assert harness(*args, "--probe-rows", "1000000000", "--out", str(tmp_path / "huge")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "headloc-harness: error: --probe-rows 1000000000: must be a whole number with "
        "2 <= value <= 4096")
    assert not (tmp_path / "huge").exists()


def test_the_types_command_checks_before_loading(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bad"
    code = harness("types", *tiny_args(tiny_model_dir("llama")), "--tasks", "no_such_task",
                   "--out", str(out))
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no_such_task" in err[-1] and "Traceback" not in "\n".join(err)
    assert not out.exists()


@pytest.mark.slow
def test_the_embedded_models_copying_heads_have_their_types(smollm2, tmp_path):
    """The default run's copying heads (README) include the embedded model's strongest
    previous-token head and its strongest induction head: the induction circuit."""
    out = tmp_path / "types"
    assert harness("types", "--num-samples", "8", "--out", str(out)) == 0
    rows = {r["head"]: r for r in csv.DictReader(io.StringIO((out / "types.csv")
                                                             .read_text()))}
    assert len(rows) == 270
    assert rows["L16H0"]["type"] == "previous_token", rows["L16H0"]
    assert rows["L18H6"]["type"] == "induction", rows["L18H6"]
    induction = sorted(rows.values(), key=lambda r: -float(r["induction"]))
    assert induction[0]["head"] == "L18H6"
