"""Every command checks its arguments before it loads weights: a bad one is refused in one
line with exit status 2, and a refused measuring command writes nothing. On tiny random
models."""

from __future__ import annotations

import pytest
from helpers import fake_run, harness, last_error, tiny_args

LOCATE_BAD = [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
    (["--model-args="], "--model-args '': give pretrained=<model>"),
    (["--include-path="], "--include-path '': give a folder of task YAMLs"),
    (["--exclude="], "--exclude '': give components (L0H1+L2H3) or a head file"),
    (["--never-ablate", " "], "--never-ablate '': give components (L0H1+L2H3) or a head file"),
    (["--sparsity", "1.5"], "--sparsity 1.5: must be a finite number strictly between 0 and 1"),
    (["--sparsity", "0"], "--sparsity 0.0: must be a finite number strictly between"),
    (["--sparsity", "nan"], "--sparsity nan: must be"),
    (["--sparsity", "x"], "--sparsity 'x': must be a number strictly between 0 and 1, or 'auto'"),
    (["--sparsity", "auto", "--masks", "5"], "--masks 5: --sparsity auto's pilot alone takes 5"),
    (["--alpha", "nan"], "--alpha nan: must be a finite number > 0"),
    (["--alpha", "inf"], "--alpha inf: must be a finite number > 0"),
    (["--alpha", "-1"], "--alpha -1.0: must be a finite number > 0"),
    (["--masks", "0"], "--masks 0: must be a whole number >= 2"),
    (["--masks", "1"], "--masks 1: must be a whole number >= 2"),
    (["--masks", "x"], "--masks 'x': must be a whole number >= 2 or 'auto'"),
    (["--masks", "auto", "--max-masks", "0"], "--max-masks 0: must be a whole number >= 1"),
    (["--masks", "auto", "--max-masks", "100000000"], "--max-masks 100000000: the design"),
    (["--masks", "1000000000"], "at most 33554432 masks fit the 256 MiB limit"),
    (["--masks", "100000000"], "--masks 100000000: the design (100000000 masks x 8 heads)"),
    (["--seed", "-1"], "--seed -1: must be a whole number >= 0"),
    (["--design-seed", "-2"], "--design-seed -2: must be a whole number >= 0"),
    (["--bootstrap", "1000000000"],
     "--bootstrap 1000000000: must be a whole number with 1 <= value <= 10000"),
    (["--bootstrap", "0"], "--bootstrap 0: must be a whole number"),
    (["--num-samples", "0"], "--num-samples 0: must be a whole number >= 1"),
    (["--masks-per-pass", "0"], "--masks-per-pass 0: must be a whole number >= 1"),
    (["--batch-size", "big"], "--batch-size 'big': must be a whole number >= 1, 'auto'"),
    (["--top-k", "9"], "--top-k 9: the model has only 8 heads"),
    (["--exclude", "L29H8"], "--exclude: head L29H8 is outside"),
    (["--never-ablate", "L0H5"], "--never-ablate: head L0H5 is outside"),
    (["--exclude", "L0H*+L1H*"], "--exclude covers every head (8); nothing is left to rank"),
    (["--never-ablate", "L0H*+L1H*"], "--never-ablate covers every head"),
    (["--design", "random"], "invalid choice: 'random'"),
    (["--signal", "loud"], "invalid choice: 'loud'"),
    (["--signal", "logprob", "--tasks", "tiny_choice:acc"],
     "--tasks tiny_choice:acc,none: a metric is used only with --signal metric"),
    (["--signal", "logprob", "--tasks", "tiny_rolling"],
     "--signal logprob: task 'tiny_rolling' is loglikelihood_rolling"),
    (["--tasks", "tiny_choice:bleu"], "produces no metric 'bleu,none'; it produces: acc,none"),
    (["--tasks", "tiny_unsafe"], "task 'tiny_unsafe' executes model-written code; rerun with "
                                 "--confirm-run-unsafe-code"),
]


GREEDY_BAD = [
    (["--seed", "-1"], "--seed -1: must be a whole number >= 0"),
    (["--rounds", "0"], "--rounds 0: must be a whole number >= 1"),
    (["--rounds", "9"], "--rounds 9 / --top-k 5: only 8 heads can be knocked out"),
    (["--top-k", "9"], "--top-k 9: the model has only 8 heads"),
    (["--exclude", "L5H0"], "--exclude: head L5H0 is outside"),
    (["--never-ablate", "L0H9"], "--never-ablate: head L0H9 is outside"),
    (["--exclude", "L0H*", "--never-ablate", "L1H*"], "together cover every head"),
    (["--rounds", "2", "--tasks", "tiny_copy,tiny_choice"], "--rounds > 1 follows one task"),
    (["--num-samples", "0"], "--num-samples 0"),
    (["--tasks", "no_such_task"], "unknown task"),
]


SWEEP_BAD = [
    (["--seed", "-1"], "--seed -1"),
    (["--alpha", "nan"], "--alpha nan"),
    (["--masks", "4,1"], "--masks 1: must be a whole number >= 2"),
    (["--masks", "4,x"], "not a comma-separated list of whole numbers"),
    (["--sparsity", "0.2,1.5"], "--sparsity 1.5: must be"),
    (["--masks", "4,100000000"], "--masks 100000000: the design"),
    (["--top-k", "9"], "--top-k 9"),
    (["--design", "random"], "invalid choice"),
    (["--never-ablate", "L9H0"], "--never-ablate: head L9H0"),
]


@pytest.mark.parametrize("command, extra, message", [
    *(("locate", *case) for case in LOCATE_BAD), *(("greedy", *case) for case in GREEDY_BAD),
    *(("sweep", *case) for case in SWEEP_BAD)])
def test_measuring_commands_check_arguments_before_loading(
        tiny_model_dir, tmp_path, capsys, no_model_loading, command, extra, message):
    out = tmp_path / "run"
    code = harness(command, *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--out", str(out), *extra)
    assert code == 2
    assert message in last_error(capsys)
    assert not out.exists(), "a refused run must write nothing"


@pytest.mark.parametrize("extra, message", [
    (["--top-k", "0"], "--top-k 0: must be a whole number >= 1"),
    (["--top-k", "7"], "--top-k 7: heads-tiny_copy.json ranks only 6 heads"),
    (["--limit", "0"], "--limit 0: must be a whole number >= 1"),
    (["--general", "no_such_task"], "unknown task 'no_such_task'"),
    (["--general", "tiny_copy"], "--general tiny_copy: the run's own task, measured in the "
                                 "Task column"),
    (["--batch-size", "0"], "--batch-size 0"),
])
def test_verify_checks_arguments_before_loading(tiny_model_dir, tmp_path, capsys,
                                                no_model_loading, extra, message):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    assert harness("verify", str(run), *extra) == 2
    assert message in last_error(capsys)


def test_refit_and_universal_check_their_numbers(tiny_locate_run, tmp_path, capsys):
    for args, message in [
        (["refit", str(tiny_locate_run), "--alpha", "nan"], "--alpha nan: must be a finite"),
        (["refit", str(tiny_locate_run), "--alpha", "inf"], "--alpha inf"),
        (["refit", str(tiny_locate_run), "--top-k", "0"], "--top-k 0"),
        (["refit", str(tiny_locate_run), "--top-k", "9"], "the run ranks only 8 components"),
        (["refit", str(tiny_locate_run), "--exclude", "L0H*+L1H*"],
         "covers every component the run ranks (8)"),
        (["universal", str(tiny_locate_run), str(tiny_locate_run), "--min-tasks", "0"],
         "--min-tasks 0"),
    ]:
        assert harness(*args) == 2, args
        assert message in last_error(capsys), args
