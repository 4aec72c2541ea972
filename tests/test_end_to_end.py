"""The real thing: localization on the embedded SmolLM2, checked by knocking heads out."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lm_eval_headloc.intervention.embedded import smollm2_model_args


@pytest.mark.slow
def test_locate_finds_heads_that_really_break_induction(smollm2, tmp_path, monkeypatch):
    import gguf

    from lm_eval_headloc.cli.main import main  # the headloc-harness entry point

    # Each parse of the 94 MB GGUF costs seconds: the argument check, HFLM's config,
    # tokenizer and weights, and the second model below share one (gguf_reads).
    parsed, parse = [], gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__",
                        lambda self, *a, **k: parsed.append(a) or parse(self, *a, **k))

    out = tmp_path / "induction"
    # The defaults: the two-point prior, 12 masks, 34 heads confirmed alone in rounds, group
    # tests until certified; 32 examples, not 64, to keep the suite short (the bars below
    # are this subset's own).
    code = main(["locate", "--tasks", "headloc_induction", "--num-samples", "32",
                 "--top-k", "3", "--seed", "0", "--batch-size", "32", "--out", str(out)])
    assert code == 0
    heads = json.loads((out / "heads.json").read_text())
    top3 = heads["top_k"]
    assert len(top3) == 3
    # Then group tests until certified or the default cap, half of the 270 heads.
    cert = heads["certificate"]
    assert cert["max_measurements"] == 135 and cert["measurements_spent"] <= 135
    assert cert["measured_alone"] + cert["ruled_out"] + len(cert["unchecked"]) == 270
    assert cert["certified"] == (not cert["unchecked"]) and cert["confidence"] == 0.95
    subset = json.loads((out / "config.json").read_text())["example_subset"]  # task -> docs

    # The control: as many heads as were located, drawn at random from the others and
    # knocked out together.
    others = [entry["head"] for entry in heads["heads"] if entry["head"] not in top3]
    control = "+".join(np.random.default_rng(0).choice(others, size=3, replace=False))

    # Knock each head out alone through hf-headablate and the harness, on the same subset.
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM
    from lm_eval_headloc.tasks import make_task_manager

    manager = make_task_manager()  # the one the run used, kept per process
    lm = HFHeadAblateLM.create_from_arg_string(smollm2_model_args(), {"batch_size": 32})
    assert len(parsed) <= 1  # 9 before: 5 for the command, 4 for this load
    scores = {}
    for spec in ["", *top3, control]:
        lm.set_heads(spec)
        results = lm_eval.simple_evaluate(model=lm, tasks=["headloc_induction"], samples=subset,
                                          task_manager=manager, bootstrap_iters=0)
        scores[spec] = results["results"]["headloc_induction"]["acc,none"]
    baseline = scores[""]
    assert baseline == pytest.approx(heads["baseline"])  # locate measured the same thing
    drops = {spec: baseline - score for spec, score in scores.items() if spec}
    # The top heads were measured alone by locate: the same changes as the stock harness's.
    by_head = {entry["head"]: entry for entry in heads["heads"]}
    for head in top3:
        assert by_head[head]["measured_alone"] is True
        assert by_head[head]["effect"] == pytest.approx(-drops[head], abs=1e-9)
    best = max(top3, key=drops.get)
    # Bars from this run, not from a score seen once: (1) one located head alone hurts
    # more than three random heads together; (2) its drop exceeds 4 binomial standard
    # errors of the baseline accuracy on these n documents (the "clearly above chance"
    # bar of test_capability_tasks), so it is not a few documents changing their answer.
    assert drops[best] > drops[control], drops
    n = len(subset["headloc_induction"])
    noise = math.sqrt(baseline * (1 - baseline) / n)
    assert drops[best] > 4 * noise, (drops, noise)
