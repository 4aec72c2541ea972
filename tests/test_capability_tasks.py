"""The offline capability tasks: deterministic data, lm-eval loading, and real baselines."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_eval_headloc.tasks.generators import (
    COMMON_WORDS,
    FIRST_NAMES,
    GENERATORS,
    HELDOUT_IOI_OBJECTS,
    HELDOUT_IOI_PLACES,
    HELDOUT_IOI_TEMPLATES,
    HELDOUT_NAMES,
    IOI_OBJECTS,
    IOI_PLACES,
    IOI_TEMPLATES,
    KV_PAIRS,
    SUCCESSOR_RUN_LEN,
    SUCCESSOR_SEQUENCES,
    chance_accuracy,
    data_file,
    docs_to_jsonl,
    main,
    make_arith_docs,
    make_heldout_ioi_b_docs,
    make_heldout_kv_recall_docs,
    make_heldout_successor_docs,
    make_induction_docs,
    make_ioi_docs,
)

REPO = Path(__file__).resolve().parents[1]
TASK_CONFIGS = REPO / "task_configs"
TASKS = list(GENERATORS)
TUNED = [t for t in TASKS if t.startswith("headloc_")]  # tag headloc: defaults chosen on them
HELDOUT = [t for t in TASKS if t.startswith("heldout_")]  # tag headloc_heldout: only reported
METRIC = "acc,none"  # every headloc task reports this key
BASELINE_LIMIT = 64


def _committed_docs(task: str) -> list[dict]:
    lines = data_file(TASK_CONFIGS, task).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


# --- generators ----------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_gives_identical_bytes_other_seed_differs(task):
    generate = GENERATORS[task]
    assert docs_to_jsonl(generate(7)) == docs_to_jsonl(generate(7))
    assert docs_to_jsonl(generate(7)) != docs_to_jsonl(generate(8))


@pytest.mark.parametrize("task", TASKS)
def test_committed_data_is_the_generator_output(task):
    expected = docs_to_jsonl(GENERATORS[task](1234)).encode("utf-8")
    assert data_file(TASK_CONFIGS, task).read_bytes() == expected, (
        f"{task} data is stale; run: python -m lm_eval_headloc.tasks.generators --out task_configs"
    )


def test_main_rewrites_byte_identical_files(tmp_path):
    assert main(["--out", str(tmp_path)]) == 0
    for task in TASKS:
        written = data_file(tmp_path, task).read_bytes()
        assert written == data_file(TASK_CONFIGS, task).read_bytes()
    assert main(["--out", str(tmp_path), "--seed", "5"]) == 0
    changed = data_file(tmp_path, "headloc_ioi").read_bytes()
    assert changed != data_file(TASK_CONFIGS, "headloc_ioi").read_bytes()


def test_main_into_a_closed_pipe_exits_quietly(tmp_path):
    """`python -m lm_eval_headloc.tasks.generators --out DIR | head -1` ended in a
    BrokenPipeError traceback once head had stopped reading."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "lm_eval_headloc.tasks.generators",
                               "--out", str(tmp_path)], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, check=False)
    finally:
        os.close(write)
    assert done.returncode == 0 and done.stderr == ""
    assert all(data_file(tmp_path, task).is_file() for task in GENERATORS)


def test_main_refuses_an_out_that_is_no_folder_in_one_line(tmp_path, capsys):
    """--out naming a file ended in a NotADirectoryError traceback; a data file's place
    taken by a folder in an IsADirectoryError, after the files before it were written."""
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    for out in (afile, afile / "sub"):
        assert main(["--out", str(out)]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"--out {out}: {afile} is not a folder" in error
    assert afile.read_text() == "mine"
    taken = data_file(tmp_path / "tc", TASKS[-1])
    taken.mkdir(parents=True)
    assert main(["--out", str(tmp_path / "tc")]) == 2
    assert f"{taken} is a folder" in capsys.readouterr().err
    assert not data_file(tmp_path / "tc", TASKS[0]).exists()  # nothing written


@pytest.mark.parametrize("task", TASKS)
def test_at_least_200_docs_with_unique_ids(task):
    docs = _committed_docs(task)
    assert len(docs) >= 200
    assert [d["id"] for d in docs] == list(range(len(docs)))


def test_induction_target_is_the_next_word_of_the_repeat():
    for doc in make_induction_docs():
        words, k = doc["words"], doc["repeat_len"]
        assert len(set(words)) == len(words) >= 10  # distinct: the next word is unambiguous
        assert 1 <= k < len(words)
        assert doc["context"].split() == words + words[:k]
        assert doc["target"] == " " + words[k]
        assert set(words) <= set(COMMON_WORDS)


def test_ioi_answer_is_the_name_not_repeated_and_positions_are_balanced():
    docs = make_ioi_docs()
    for doc in docs:
        a, b = doc["choices"]
        answer, subject = doc["choices"][doc["label"]], doc["choices"][1 - doc["label"]]
        assert a != b and {a, b} <= set(FIRST_NAMES)
        words = doc["context"].split()
        # both names are introduced in order, then only the subject comes back
        assert words.index(a) < words.index(b)
        assert words.count(answer) == 1
        assert words.count(subject) == 2
    first_share = sum(d["label"] == 0 for d in docs) / len(docs)
    assert first_share == 0.5
    assert chance_accuracy("headloc_ioi", docs) == 0.5
    with pytest.raises(ValueError, match="even"):
        make_ioi_docs(n=3)


def test_arith_answers_are_sums_and_examples_are_right():
    docs = make_arith_docs()
    for doc in docs:
        *shots, question = doc["context"].split("\n")
        assert question == f"{doc['a']} + {doc['b']} ="
        assert doc["answer"] == doc["a"] + doc["b"]
        assert doc["target"] == f" {doc['answer']}\n"
        for line in shots:
            left, right = line.split(" = ")
            x, y = map(int, left.split(" + "))
            assert x + y == int(right)
            assert {x, y} != {doc["a"], doc["b"]}  # the question itself is never shown
    pairs = {(d["a"], d["b"]) for d in docs}
    assert len(pairs) == 100  # every single-digit pair is asked
    assert chance_accuracy("headloc_arith", docs) == pytest.approx(0.10)


def test_every_task_is_tuned_on_or_held_out_by_its_name_and_tag():
    assert TUNED == ["headloc_induction", "headloc_ioi", "headloc_arith"]
    assert HELDOUT == ["heldout_successor", "heldout_ioi_b", "heldout_kv_recall"]
    for task in TASKS:
        tag = "headloc" if task in TUNED else "headloc_heldout"
        yaml = (TASK_CONFIGS / task / f"{task}.yaml").read_text(encoding="utf-8")
        assert f"\ntask: {task}\n" in yaml and f"\ntag: {tag}\n" in yaml
        assert f'"{task}.jsonl"' in (TASK_CONFIGS / task / "utils.py").read_text(encoding="utf-8")


def test_successor_asks_every_run_once_and_its_target_is_the_next_item():
    docs = make_heldout_successor_docs()
    runs = set()
    for doc in docs:
        header, items, wraps = SUCCESSOR_SEQUENCES[doc["sequence"]]
        shown = doc["shown"]
        assert SUCCESSOR_RUN_LEN[0] <= len(shown) <= SUCCESSOR_RUN_LEN[1]
        start = items.index(shown[0])
        expected = [items[(start + j) % len(items)] for j in range(len(shown) + 1)]
        assert wraps or start + len(shown) < len(items)  # only days and months wrap around
        assert shown == expected[:-1]
        assert doc["target"] == " " + expected[-1]
        assert doc["context"] == f"{header}: " + ", ".join(shown) + ","
        runs.add((doc["sequence"], start, len(shown)))
    # every run of every sequence once: 7 and 12 starts a length for the wrapping ones
    lengths = range(SUCCESSOR_RUN_LEN[0], SUCCESSOR_RUN_LEN[1] + 1)
    expected_count = sum(len(items) if wraps else len(items) - n
                         for _, items, wraps in SUCCESSOR_SEQUENCES.values() for n in lengths)
    assert len(runs) == len(docs) == expected_count == 266
    assert [d["id"] for d in docs] == list(range(len(docs)))
    assert {d["sequence"] for d in docs} == set(SUCCESSOR_SEQUENCES)
    # the seed only reorders the same runs
    def asked(some):
        return sorted((d["sequence"], d["context"], d["target"]) for d in some)
    assert asked(make_heldout_successor_docs(7)) == asked(docs)
    assert chance_accuracy("heldout_successor", docs) == pytest.approx(0.1, abs=0.01)


def _template_of(context: str) -> str:
    """The one held-out IOI template ``context`` was made from, its slots filled from the
    held-out pools."""
    import re

    names = "|".join(HELDOUT_NAMES)
    slots = {"{a}": f"(?:{names})", "{b}": f"(?:{names})", "{s}": f"(?:{names})",
             "{place}": f"(?:{'|'.join(HELDOUT_IOI_PLACES)})",
             "{obj}": f"(?:{'|'.join(HELDOUT_IOI_OBJECTS)})"}
    matched = []
    for template in HELDOUT_IOI_TEMPLATES:
        pattern = re.escape(template)
        for slot, alternatives in slots.items():
            pattern = pattern.replace(re.escape(slot), alternatives)
        if re.fullmatch(pattern, context):
            matched.append(template)
    assert len(matched) == 1, (context, matched)
    return matched[0]


def test_ioi_b_is_ioi_in_other_words_and_positions_are_balanced():
    docs = make_heldout_ioi_b_docs()
    for doc in docs:
        a, b = doc["choices"]
        answer, subject = doc["choices"][doc["label"]], doc["choices"][1 - doc["label"]]
        assert a != b and {a, b} <= set(HELDOUT_NAMES)
        words = doc["context"].split()
        assert words.index(a) < words.index(b)
        assert words.count(answer) == 1
        assert words.count(subject) == 2
        assert words.index(subject, words.index(b) + 1) > words.index(b)
    assert sum(d["label"] == 0 for d in docs) / len(docs) == 0.5
    assert chance_accuracy("heldout_ioi_b", docs) == 0.5
    # held out from headloc_ioi: none of its templates, names, places or objects
    assert not set(HELDOUT_NAMES) & set(FIRST_NAMES)
    assert not set(HELDOUT_IOI_PLACES) & set(IOI_PLACES)
    assert not set(HELDOUT_IOI_OBJECTS) & set(IOI_OBJECTS)
    assert not set(HELDOUT_IOI_TEMPLATES) & set(IOI_TEMPLATES)
    used = [_template_of(d["context"]) for d in docs]
    assert set(used) == set(HELDOUT_IOI_TEMPLATES)
    with pytest.raises(ValueError, match="even"):
        make_heldout_ioi_b_docs(n=3)


def test_kv_recall_target_is_the_asked_keys_value():
    docs = make_heldout_kv_recall_docs()
    for doc in docs:
        keys, values, demo, query = doc["keys"], doc["values"], doc["demo"], doc["query"]
        assert KV_PAIRS[0] <= len(keys) == len(values) <= KV_PAIRS[1]
        assert len(set(keys + values)) == 2 * len(keys)  # no word is a key and a value
        assert set(keys + values) <= set(COMMON_WORDS)
        assert demo != query
        table, asked = doc["context"].split("\n\n")
        assert table.split("\n") == [f"{k}: {v}" for k, v in zip(keys, values, strict=True)]
        assert asked == f"{keys[demo]}: {values[demo]}\n{keys[query]}:"
        assert doc["target"] == " " + values[query]
    assert {len(d["keys"]) for d in docs} == set(range(KV_PAIRS[0], KV_PAIRS[1] + 1))
    assert 0.2 < chance_accuracy("heldout_kv_recall", docs) < 0.3


def test_chance_levels_by_hand_and_unknown_task_is_refused():
    # Hand-made docs, one per branch of the best trivial predictor.
    two, four = ["w0", "w1"], ["w0", "w1", "w2", "w3"]
    docs = [{"words": two, "target": " a"}, {"words": four, "target": " b"},
            {"words": four, "target": " c"}, {"words": four, "target": " d"}]
    # guessing a word of the sequence: (1/2 + 3 * 1/4) / 4, better than any fixed target (1/4)
    assert chance_accuracy("headloc_induction", docs) == pytest.approx(0.3125)
    assert chance_accuracy("headloc_induction", docs[:1] * 3) == 1.0  # always " a"
    assert chance_accuracy("headloc_ioi", [{"label": 0}] * 3 + [{"label": 1}]) == 0.75
    assert chance_accuracy("headloc_arith", [{"answer": a} for a in (3, 3, 5, 7, 9)]) == 0.4
    assert chance_accuracy("heldout_ioi_b", [{"label": 1}] * 3 + [{"label": 0}]) == 0.75
    # successor: guessing among the 7 - 5 and 7 - 4 days not shown, better than any
    # fixed target (1/3)
    week = list(SUCCESSOR_SEQUENCES["days"][1])
    succ = [{"sequence": "days", "shown": week[:5], "target": " x"},
            {"sequence": "days", "shown": week[:4], "target": " y"},
            {"sequence": "days", "shown": week[1:6], "target": " z"}]
    assert chance_accuracy("heldout_successor", succ) == pytest.approx((1 / 2 + 1 / 3 + 1 / 2) / 3)
    assert chance_accuracy("heldout_successor", succ[:1] * 2) == 1.0  # always " x"
    # kv recall: guessing among the values but the one answered in the context
    kv = [{"values": list("abc"), "target": " x"}, {"values": list("abc"), "target": " y"},
          {"values": list("abcde"), "target": " z"}]
    assert chance_accuracy("heldout_kv_recall", kv) == pytest.approx((1 / 2 + 1 / 2 + 1 / 4) / 3)
    assert chance_accuracy("heldout_kv_recall", kv[:1] * 2) == 1.0
    # The committed induction data: at least 10 distinct words a sequence, so guessing
    # among them is right at most 1/10 of the time, and no target repeats more than that.
    assert chance_accuracy("headloc_induction", make_induction_docs()) <= 0.1
    with pytest.raises(ValueError, match="unknown task"):
        chance_accuracy("nope", [{}])


# --- lm-eval loading ---------------------------------------------------------------


@pytest.fixture(scope="module")
def task_dict():
    """The headloc tasks loaded by lm-eval from another working directory."""
    from lm_eval.tasks import get_task_dict

    from lm_eval_headloc.tasks import make_task_manager

    cwd = os.getcwd()
    os.chdir(REPO.parent)  # the data must be found without relying on the working dir
    try:
        # lm-eval's TaskManager over the built-ins (their index read from the package's
        # cache, not parsed again) and TASK_CONFIGS, the package's own task folder.
        manager = make_task_manager()
        return get_task_dict(TASKS, manager), manager
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("task", TASKS)
def test_yaml_loads_through_lm_eval_with_all_docs(task, task_dict):
    tasks, _ = task_dict
    loaded = tasks[task]
    docs = _committed_docs(task)
    assert len(loaded.eval_docs) == len(docs)
    first = loaded.eval_docs[0]
    assert loaded.doc_to_text(first) == docs[0]["context"]
    # the request lm-eval builds is exactly (context, expected continuation)
    instances = loaded.construct_requests(first, loaded.doc_to_text(first))
    instances = instances if isinstance(instances, list) else [instances]
    continuations = [inst.arguments[1] for inst in instances]
    if "choices" in docs[0]:  # the two IOI tasks
        assert continuations == [f" {name}" for name in docs[0]["choices"]]
    else:
        assert continuations == [docs[0]["target"]]


def test_headloc_tag_covers_the_three_tasks_and_the_held_out_tag_the_others(task_dict):
    from lm_eval.tasks import get_task_dict

    _, manager = task_dict
    assert set(get_task_dict(["headloc"], manager)) == set(TUNED)
    assert set(get_task_dict(["headloc_heldout"], manager)) == set(HELDOUT)


def test_every_task_is_scored_by_acc(task_dict):
    """The held-out tasks are in no table of metrics.py: they are scored by the first
    metric their YAML lists, and they list acc alone."""
    from lm_eval_headloc.measurement.metrics import default_metric

    tasks, _ = task_dict
    for task in TASKS:
        assert default_metric(task, tasks[task]) == METRIC
    for task in HELDOUT:
        assert [m["metric"] for m in tasks[task].config.metric_list] == ["acc"]


# --- the embedded real model (slow) ------------------------------------------------


def _binomial_bar(chance: float, n: int, sigmas: float = 4.0) -> float:
    """Score a trivial predictor reaches with probability ~1e-4 on n docs."""
    return chance + sigmas * math.sqrt(chance * (1 - chance) / n)


def test_arith_prompts_never_show_the_questions_own_pair_even_asked_for_few_shot():
    """lm-eval draws few-shot examples from the same documents, where every pair is asked
    three times: --num_fewshot 2 showed 51 of 300 questions their own pair answered. The
    YAML fixes 0 (the prompt holds its own examples), which lm-eval keeps."""
    import re

    from lm_eval_headloc.measurement.harness import configure_tasks
    from lm_eval_headloc.tasks import make_task_manager

    tasks = make_task_manager().load(["headloc_arith"])["tasks"]
    configure_tasks(tasks, num_fewshot=2)  # as simple_evaluate applies --num_fewshot 2
    task = tasks["headloc_arith"]
    task.set_fewshot_seed(seed=1234)
    for doc in task.test_docs():
        a, b = doc["a"], doc["b"]
        *shown, asked = task.fewshot_context(doc, task.get_config("num_fewshot")).split("\n")
        assert asked == f"{a} + {b} ="
        assert not [line for line in shown if re.match(rf"({a} \+ {b}|{b} \+ {a}) =", line)]


@pytest.mark.slow
def test_stock_cli_runs_every_task(smollm2, tmp_path):
    folder, gguf = smollm2
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # The device goes in --device: the stock CLI always passes one (default cuda:0), so a
    # device= in --model_args as well would be a duplicate keyword argument.
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf-headablate",
        "--model_args", f"pretrained={folder},gguf_file={gguf},dtype=float32",
        "--device", "cpu", "--tasks", ",".join(TASKS),
        "--include_path", str(TASK_CONFIGS), "--batch_size", "8", "--limit", "2",
        "--output_path", str(tmp_path / "out"), "--log_samples",
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [results_file] = list((tmp_path / "out").rglob("results_*.json"))
    results = json.loads(results_file.read_text())["results"]
    for task in TASKS:
        [samples_file] = list((tmp_path / "out").rglob(f"samples_{task}_*.jsonl"))
        samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
        docs = _committed_docs(task)
        assert sorted(s["doc_id"] for s in samples) == [0, 1]
        # Each answer from the model's own numbers, not the harness's scorer: the logged
        # (log-likelihood, is-greedy) pairs, written as strings.
        right = []
        for sample in samples:
            doc = docs[sample["doc_id"]]
            pairs = [(float(ll), greedy == "True") for ll, greedy in sample["filtered_resps"]]
            if "choices" in doc:  # one pair per name: the likelier name is the answer
                likelihoods = [ll for ll, _ in pairs]
                right.append(likelihoods.index(max(likelihoods)) == doc["label"])
            else:  # the target is the model's greedy continuation
                assert sample["arguments"]["gen_args_0"]["arg_1"] == doc["target"]
                right.append(pairs[0][1])
        assert results[task][METRIC] == pytest.approx(sum(right) / len(right)), task


@pytest.mark.slow
def test_words_and_names_are_single_tokens_for_smollm2(embedded_lm):
    tokenizer = embedded_lm.tokenizer
    items = tuple(item for _, seq, _ in SUCCESSOR_SEQUENCES.values() for item in seq)
    words = COMMON_WORDS + FIRST_NAMES + HELDOUT_NAMES + items
    multi = [w for w in words if len(tokenizer.tokenize(" " + w)) != 1]
    assert not multi


@pytest.mark.slow
def test_smollm2_baselines_are_clearly_above_chance(embedded_lm, task_dict):
    from lm_eval.evaluator import evaluate

    tasks, _ = task_dict
    assert embedded_lm.batch_size == 64 and not embedded_lm.knocked_out
    results = evaluate(
        lm=embedded_lm, task_dict=tasks, limit=BASELINE_LIMIT, bootstrap_iters=0,
        log_samples=False, verbosity="ERROR",
    )["results"]
    for task in TASKS:
        chance = chance_accuracy(task, _committed_docs(task)[:BASELINE_LIMIT])
        bar = _binomial_bar(chance, BASELINE_LIMIT)
        assert results[task][METRIC] > bar, (task, results[task][METRIC], chance)
    for task in HELDOUT:  # room below the baseline for a knockout to show
        assert results[task][METRIC] < 0.95, (task, results[task][METRIC])


def test_lm_eval_does_not_tell_our_tasks_loaders_about_metadata_they_do_not_take(caplog):
    """lm-eval notes on every load of a ``custom_dataset`` task that it takes --metadata;
    ours ignore it, and a notebook saw the note at every command. Other tasks keep it."""
    import logging

    from helpers import TASKS as TEST_TASKS

    from lm_eval_headloc.tasks import make_task_manager

    manager = make_task_manager([TEST_TASKS])
    notice = "Custom kwargs can be passed to `--metadata`"
    with caplog.at_level(logging.WARNING, logger="lm_eval"):
        manager.load(["headloc_induction", "swear"])
        assert not [r for r in caplog.records if notice in r.getMessage()]
        manager.load(["tiny_choice"])  # a test task's own custom_dataset: said, as lm-eval does
    assert [r.getMessage().split(":")[0] for r in caplog.records
            if notice in r.getMessage()] == ["tiny_choice"]
