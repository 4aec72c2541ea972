"""Every command checks its arguments before it loads weights: a bad one is refused in one
line with exit status 2, and a refused measuring command writes nothing. On tiny random
models."""

from __future__ import annotations

import pytest
from helpers import assert_names, fake_run, harness, last_error, tiny_args

# Each bad argument and the values its refusal names: the value given and, where the
# message gives it, what is allowed (not the sentence around them).
LOCATE_BAD = [
    (["--tasks", "no_such_task"], ("'no_such_task'",)),
    (["--model-args="], ("--model-args ''", "pretrained=<model>")),
    (["--include-path="], ("--include-path ''",)),
    (["--exclude="], ("--exclude ''", "L0H1+L2H3")),
    (["--never-ablate", " "], ("--never-ablate ''", "L0H1+L2H3")),
    (["--sparsity", "1.5"], ("--sparsity 1.5", "0 and 1")),
    (["--sparsity", "0"], ("--sparsity 0.0", "0 and 1")),
    (["--sparsity", "nan"], ("--sparsity nan",)),
    (["--sparsity", "x"], ("--sparsity 'x'", "0 and 1", "'auto'")),
    (["--sparsity", "auto", "--masks", "5"], ("--masks 5", "--sparsity auto")),
    (["--alpha", "nan"], ("--alpha nan", "> 0")),
    (["--alpha", "inf"], ("--alpha inf", "> 0")),
    (["--alpha", "-1"], ("--alpha -1.0", "> 0")),
    (["--masks", "0"], ("--masks 0", ">= 2", "'auto'")),
    (["--masks", "1"], ("--masks 1", ">= 2", "'auto'")),
    (["--masks", "x"], ("--masks 'x'", ">= 2", "'auto'")),
    (["--masks", "auto", "--max-masks", "0"], ("--max-masks 0", ">= 1")),
    (["--max-measurements", "0"], ("--max-measurements 0", "from 1 to", "'auto'")),
    (["--max-measurements", "x"], ("--max-measurements 'x'", "from 1 to", "'auto'")),
    (["--max-measurements", "2.5"], ("--max-measurements",)),
    # The masks and the heads measured alone it was given take more than the cap.
    # --confirm 34 on the model's 8 heads measures 8: 12 + 8 + the prior's 8 = 28.
    (["--masks", "12", "--confirm", "34", "--prior", "atp-path", "--max-measurements", "27"],
     ("--max-measurements 27", "28", "12 masks", "8 heads")),
    (["--masks", "10", "--confirm", "5", "--prior", "none", "--max-measurements", "14"],
     ("--max-measurements 14", "15")),
    (["--masks", "10", "--confirm", "1", "--prior", "none", "--max-measurements", "10"],
     ("--max-measurements 10", "10 masks and 1 head measured alone take 11")),
    (["--masks", "auto", "--max-masks", "100000000"], ("--max-masks 100000000", "33554432")),
    (["--masks", "1000000000"], ("--masks 1000000000", "33554432", "256 MiB")),
    (["--masks", "100000000"], ("--masks 100000000", "8 heads", "33554432")),
    (["--seed", "-1"], ("--seed -1", ">= 0")),
    (["--design-seed", "-2"], ("--design-seed -2", ">= 0")),
    (["--bootstrap", "1000000000"], ("--bootstrap 1000000000", "1 <= value <= 10000")),
    (["--bootstrap", "0"], ("--bootstrap 0",)),
    (["--num-samples", "0"], ("--num-samples 0", ">= 1")),
    (["--masks-per-pass", "0"], ("--masks-per-pass 0", ">= 1")),
    (["--batch-size", "big"], ("--batch-size 'big'", ">= 1", "'auto'")),
    (["--top-k", "9"], ("--top-k 9", "8 heads")),
    (["--scale", "1"], ("--scale 1", "as it is")),  # ran, every measurement the baseline
    # tiny_choice's 4 documents: part 5 of 8 held none, and a run took them all.
    (["--examples-part", "5/8"], ("--examples-part 5/8", "'tiny_choice' has 4 documents",
                                  "holds none")),
    # A top-5 of the 4 heads left used to run, its report speaking of a top-5.
    (["--exclude", "L0H*"], ("--top-k 5", "only 4 heads", "less 4")),
    (["--exclude", "L0H0+L0H1", "--never-ablate", "L1H0+L1H1"], ("--top-k 5", "only 4 heads")),
    (["--exclude", "L29H8"], ("--exclude", "L29H8", "0..1")),
    (["--never-ablate", "L0H5"], ("--never-ablate", "L0H5", "0..3")),
    (["--exclude", "L0H*+L1H*"], ("--exclude", "(8)")),
    (["--never-ablate", "L0H*+L1H*"], ("--never-ablate", "(8)")),
    (["--design", "random"], ("'random'", "'bernoulli', 'stratified'")),
    (["--signal", "loud"], ("'loud'", "'metric', 'logprob'")),
    (["--signal", "logprob", "--tasks", "tiny_choice:acc"],
     ("--tasks tiny_choice:acc,none", "--signal metric")),
    (["--signal", "logprob", "--tasks", "tiny_rolling"],
     ("--signal logprob", "'tiny_rolling'", "loglikelihood_rolling")),
    (["--tasks", "tiny_choice:bleu"], ("'tiny_choice'", "'bleu,none'", "acc,none")),
    (["--tasks", "tiny_unsafe"], ("'tiny_unsafe'", "--confirm-run-unsafe-code")),
]


GREEDY_BAD = [
    (["--examples-part", "5/8"], ("--examples-part 5/8", "holds none")),
    (["--seed", "-1"], ("--seed -1", ">= 0")),
    (["--rounds", "0"], ("--rounds 0", ">= 1")),
    (["--rounds", "9"], ("--rounds 9", "--top-k 5", "8 heads")),
    (["--top-k", "9"], ("--top-k 9", "8 heads")),
    (["--exclude", "L5H0"], ("--exclude", "L5H0", "0..1")),
    (["--never-ablate", "L0H9"], ("--never-ablate", "L0H9", "0..3")),
    (["--exclude", "L0H*", "--never-ablate", "L1H*"], ("--exclude", "--never-ablate", "(8)")),
    (["--rounds", "2", "--tasks", "tiny_copy,tiny_choice"], ("--rounds > 1", "one task")),
    (["--num-samples", "0"], ("--num-samples 0",)),
    (["--tasks", "no_such_task"], ("'no_such_task'",)),
]


SWEEP_BAD = [
    (["--seed", "-1"], ("--seed -1",)),
    (["--alpha", "nan"], ("--alpha nan",)),
    (["--masks", "4,1"], ("--masks 1", ">= 2")),
    (["--masks", "4,x"], ("--masks", "'4,x'")),
    (["--sparsity", "0.2,1.5"], ("--sparsity 1.5",)),
    (["--masks", "4,100000000"], ("--masks 100000000", "33554432")),
    (["--top-k", "9"], ("--top-k 9",)),
    (["--design", "random"], ("'random'",)),
    (["--never-ablate", "L9H0"], ("--never-ablate", "L9H0")),
]


@pytest.mark.parametrize("command, extra, values", [
    *(("locate", *case) for case in LOCATE_BAD), *(("greedy", *case) for case in GREEDY_BAD),
    *(("sweep", *case) for case in SWEEP_BAD)])
def test_measuring_commands_check_arguments_before_loading(
        tiny_model_dir, tmp_path, capsys, no_model_loading, command, extra, values):
    out = tmp_path / "run"
    code = harness(command, *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--out", str(out), *extra)
    assert code == 2
    assert_names(last_error(capsys), " error: ", *values)  # ours or argparse's one line
    assert not out.exists(), "a refused run must write nothing"


@pytest.mark.parametrize("extra, values", [
    (["--top-k", "0"], ("--top-k 0", ">= 1")),
    (["--top-k", "7"], ("--top-k 7", "heads-tiny_copy.json", "6 heads")),
    (["--limit", "0"], ("--limit 0", ">= 1")),
    (["--general", "no_such_task"], ("'no_such_task'",)),
    (["--general", "tiny_copy"], ("--general tiny_copy", "Task column")),
    (["--batch-size", "0"], ("--batch-size 0",)),
])
def test_verify_checks_arguments_before_loading(tiny_model_dir, tmp_path, capsys,
                                                no_model_loading, extra, values):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    assert harness("verify", str(run), *extra) == 2
    assert_names(last_error(capsys), " error: ", *values)


def test_refit_and_universal_check_their_numbers(tiny_locate_run, tmp_path, capsys):
    for args, values in [
        (["refit", str(tiny_locate_run), "--alpha", "nan"], ("--alpha nan", "> 0")),
        (["refit", str(tiny_locate_run), "--alpha", "inf"], ("--alpha inf",)),
        (["refit", str(tiny_locate_run), "--top-k", "0"], ("--top-k 0",)),
        (["refit", str(tiny_locate_run), "--top-k", "9"], ("--top-k 9", "8 components")),
        (["refit", str(tiny_locate_run), "--exclude", "L0H*+L1H*"], ("--exclude", "(8)")),
        (["universal", str(tiny_locate_run), str(tiny_locate_run), "--min-tasks", "0"],
         ("--min-tasks 0",)),
    ]:
        assert harness(*args) == 2, args
        assert_names(last_error(capsys), " error: ", *values)


@pytest.mark.parametrize(("out", "said"), [("runs/x", "runs/x/"), ("runs/x/", "runs/x/"),
                                           ("runs/x//", "runs/x/")])
def test_the_last_line_names_the_run_folder_with_one_slash(out, said):
    """``--out runs/x/`` printed 'Results in runs/x// (...)'."""
    from pathlib import Path

    from lm_eval_headloc.cli.main import _folder_words

    assert _folder_words(out) == said and _folder_words(Path(out)) == said
