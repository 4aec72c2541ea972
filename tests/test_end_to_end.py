"""The real thing: localization on the embedded SmolLM2, checked by knocking heads out."""

from __future__ import annotations

import json

import pytest

from lm_eval_headloc.cli import main
from lm_eval_headloc.embedded import smollm2_model_args


@pytest.mark.slow
def test_locate_finds_heads_that_really_break_induction(smollm2, tmp_path):
    out = tmp_path / "induction"
    code = main(["locate", "--tasks", "headloc_induction", "--num-samples", "64",
                 "--masks", "60", "--sparsity", "0.03", "--top-k", "3", "--seed", "0",
                 "--batch-size", "64", "--out", str(out)])
    assert code == 0
    heads = json.loads((out / "heads.json").read_text())
    top3 = heads["top_k"]
    assert len(top3) == 3
    subset = json.loads((out / "config.json").read_text())["example_subset"]

    # Knock each head out alone through hf-headablate and the harness, on the same subset.
    import lm_eval
    from lm_eval.tasks import TaskManager

    from lm_eval_headloc.tasks import task_configs_dir

    manager = TaskManager(include_path=str(task_configs_dir()))
    scores = {}
    from lm_eval_headloc.model import HFHeadAblateLM

    lm = HFHeadAblateLM.create_from_arg_string(smollm2_model_args(), {"batch_size": 64})
    for spec in ["", *top3]:
        lm.set_heads(spec)
        results = lm_eval.simple_evaluate(model=lm, tasks=["headloc_induction"], samples=subset,
                                          task_manager=manager, bootstrap_iters=0)
        scores[spec] = results["results"]["headloc_induction"]["acc,none"]
    baseline = scores[""]
    assert baseline == pytest.approx(heads["baseline"])
    drops = {h: (baseline - scores[h]) / baseline for h in top3}
    assert max(drops.values()) >= 0.40, drops
