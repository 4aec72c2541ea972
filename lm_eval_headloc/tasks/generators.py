"""Small offline capability tasks: deterministic generators for their lm-eval data files.

Nothing can be downloaded from the Hugging Face Hub on the development machines, so the
project ships three tasks that run anywhere and that even a 135M model really does:

- ``headloc_induction``: random common words, then their beginning again; the target is
  the next word of the repeat (in-context copying). Scored by greedy match.
- ``headloc_ioi``: indirect-object identification ("When Mary and John went to the store,
  John gave a drink to" -> " Mary"), a choice between the two names.
- ``headloc_arith``: few-shot single-digit addition ("6 + 1 =" -> " 7"), greedy match.

Three more families are held out: no default of the method was (or may be) chosen on
them; they only report how the defaults do on tasks they were not tuned on. Their names
start with ``heldout_`` and their YAMLs carry the tag ``headloc_heldout``:

- ``heldout_successor``: the next item of a named ordered sequence ("Days: Monday,
  Tuesday," -> " Wednesday"; months, number words, ordinals, letters). Greedy match.
- ``heldout_ioi_b``: indirect-object identification with templates, names, places and
  objects that ``headloc_ioi`` does not use ("Laura met Kevin at the zoo, and Kevin
  thanked" -> " Laura"), a choice between the two names.
- ``heldout_kv_recall``: a list of ``key: value`` lines, one key asked and answered,
  then another key asked ("stone:" -> " chair"). Greedy match.

Each generator is a pure function ``seed -> list of docs``. The committed JSONL files in
``task_configs/<task>/`` are its output for :data:`SEED`; rewrite them with

    python -m lm_eval_headloc.tasks.generators --out task_configs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.files import not_a_file

__all__ = [
    "ARITH_SHOTS",
    "COMMON_WORDS",
    "FIRST_NAMES",
    "GENERATORS",
    "HELDOUT_IOI_TEMPLATES",
    "HELDOUT_NAMES",
    "IOI_TEMPLATES",
    "N_DOCS",
    "SEED",
    "SUCCESSOR_SEQUENCES",
    "chance_accuracy",
    "data_file",
    "docs_to_jsonl",
    "make_arith_docs",
    "make_heldout_ioi_b_docs",
    "make_heldout_kv_recall_docs",
    "make_heldout_successor_docs",
    "make_induction_docs",
    "make_ioi_docs",
    "write_task_data",
]

SEED = 1234
N_DOCS = 300

# Common English words, each a single token (with its leading space) in the SmolLM2 /
# Llama-style BPE vocabularies, so greedy match on the target is a one-token decision.
COMMON_WORDS: tuple[str, ...] = tuple(
    """
    apple river green table house water paper chair window garden music money light night
    friend school family mother father summer winter spring autumn morning evening animal
    forest mountain ocean island city village market doctor teacher student letter number
    picture story song game ball book door floor wall road bridge train plane boat ship car
    bike horse bird fish tree flower grass stone sand cloud rain snow wind fire sun moon star
    sky earth gold silver iron glass wood milk bread butter cheese sugar salt coffee tea juice
    egg meat rice soup cake fruit orange lemon banana grape potato tomato onion carrot corn
    bean king queen prince child baby girl boy man woman people army church hospital office
    kitchen bedroom bottle box bag cup plate knife spoon fork shirt dress shoe hat coat button
    pencil camera phone computer radio clock watch ring key lamp bed desk mirror blanket pillow
    candle engine wheel rope chain hammer nail brush soap towel basket bucket ladder fence gate
    tower castle farm field valley desert lake beach hill cave street park blue red yellow
    black white brown purple pink happy quiet dark bright cold warm heavy simple strong soft
    sweet fresh early late small large young old rich poor busy empty full clean round sharp
    thick thin wild
    """.split()
)

# Common first names, each a single token with its leading space (names never start a
# prompt), so the two IOI choices are one-token continuations of equal length.
FIRST_NAMES: tuple[str, ...] = tuple(
    """
    Mary John James Robert Michael William David Richard Joseph Thomas Charles Daniel Matthew
    Mark Paul Andrew George Edward Jacob Peter Frank Scott Elizabeth Sarah Emily Anna Alice
    Jack Tom Sam Ben Max Alex Chris Rose Jane
    """.split()
)

# {a}/{b}: the two names in order of mention; {s}: the repeated one (the subject).
IOI_TEMPLATES: tuple[str, ...] = (
    "When {a} and {b} went to the {place}, {s} gave a {obj} to",
    "After {a} and {b} arrived at the {place}, {s} handed a {obj} to",
    "While {a} and {b} were working at the {place}, {s} passed a {obj} to",
    "Then, {a} and {b} had a long day at the {place}. {s} gave a {obj} to",
    "When {a} and {b} got a {obj} at the {place}, {s} decided to give it to",
    "Yesterday {a} and {b} met at the {place}, and {s} brought a {obj} for",
)
IOI_PLACES: tuple[str, ...] = (
    "store", "park", "school", "office", "beach", "restaurant", "library", "hospital",
    "garden", "station", "market", "museum", "cafe", "party",
)
IOI_OBJECTS: tuple[str, ...] = (
    "drink", "book", "gift", "letter", "ball", "pen", "key", "sandwich", "flower", "ticket",
    "map", "phone", "basket", "hat",
)

INDUCTION_SEQUENCE_LEN = (10, 20)  # words before the repeat, inclusive range
INDUCTION_REPEAT_LEN = (2, 5)  # words repeated before the target, inclusive range
ARITH_SHOTS = 4  # solved examples before the question
ARITH_REPEATS = 3  # each of the 100 (a, b) questions appears this often

# --- the held-out families (never used to choose a default) ---------------------------

# name -> (the header that names it, its items in order, whether it wraps around). Every
# item is a single token with its leading space, so greedy match is a one-token decision.
SUCCESSOR_SEQUENCES: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "days": ("Days", tuple("Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()),
             True),
    "months": ("Months", tuple(
        "January February March April May June July August September October November December"
        .split()), True),
    "numbers": ("Numbers", tuple(
        """one two three four five six seven eight nine ten eleven twelve thirteen fourteen
        fifteen sixteen seventeen eighteen nineteen twenty""".split()), False),
    "ordinals": ("Ordinals", tuple(
        "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth"
        .split()), False),
    "letters": ("Letters", tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), False),
}
SUCCESSOR_RUN_LEN = (2, 5)  # items shown before the asked one, inclusive range

# Names, places and objects that headloc_ioi never uses; each name a single token with its
# leading space.
HELDOUT_NAMES: tuple[str, ...] = tuple(
    """
    Laura Kevin Steven Brian Linda Susan Karen Lisa Kate Ryan Eric Adam Henry Anne Lucy Emma
    Oliver Harry Jason Ruth Carl Nick Amy Tony
    """.split()
)
# Structures headloc_ioi's templates do not have; {a}/{b}/{s} as in IOI_TEMPLATES.
HELDOUT_IOI_TEMPLATES: tuple[str, ...] = (
    "{a} and {b} were talking at the {place}. {s} said to",
    "{a} met {b} at the {place}, and {s} thanked",
    "{a} and {b} were eating lunch at the {place}. Later, {s} sent a {obj} to",
    "{a} sat next to {b} at the {place}. {s} smiled at",
    "{a} and {b} argued about a {obj} at the {place} until {s} finally gave it to",
    "{a} called {b} from the {place}. An hour later, {s} texted",
    "{a} and {b} cleaned the {place} all day, and in the evening {s} thanked",
    "{a} and {b} lost a {obj} near the {place}, and {s} blamed",
)
HELDOUT_IOI_PLACES: tuple[str, ...] = (
    "zoo", "bakery", "airport", "theater", "gym", "farm", "hotel", "harbor", "bank", "lake",
    "bridge", "concert", "mall", "church",
)
HELDOUT_IOI_OBJECTS: tuple[str, ...] = (
    "cake", "coin", "bottle", "scarf", "camera", "note", "cookie", "postcard", "candle",
    "blanket", "card", "toy", "shirt", "lamp",
)

KV_PAIRS = (4, 7)  # key: value lines, inclusive range


def make_induction_docs(seed: int = SEED, n: int = N_DOCS) -> list[dict[str, Any]]:
    """Docs for ``headloc_induction``: ``context`` ends inside a repeat, ``target`` continues it.

    ``target`` carries its leading space: lm-eval 0.4.13 sends a loglikelihood task's
    target as the continuation with no delimiter.
    A sequence of distinct common words is followed by its first ``repeat_len`` words
    again; the target is word ``repeat_len`` of the sequence, the next word of the repeat.
    Words are distinct, so the target is the only word that ever followed the last one.
    """
    rng = random.Random(f"headloc_induction:{seed}")
    docs = []
    for i in range(n):
        words = rng.sample(COMMON_WORDS, rng.randint(*INDUCTION_SEQUENCE_LEN))
        repeat_len = rng.randint(*INDUCTION_REPEAT_LEN)
        docs.append({
            "id": i,
            "words": words,
            "repeat_len": repeat_len,
            "context": " ".join(words + words[:repeat_len]),
            "target": " " + words[repeat_len],
        })
    return docs


def make_ioi_docs(seed: int = SEED, n: int = N_DOCS) -> list[dict[str, Any]]:
    """Docs for ``headloc_ioi``: choose between the two names, the non-repeated one is right.

    ``choices`` are the names in order of mention and ``label`` the index of the answer.
    Exactly half the docs repeat the second name (answer: the first), so always picking
    the first or always the second name scores 50 %.
    """
    return _ioi_docs("headloc_ioi", seed, n, FIRST_NAMES, IOI_TEMPLATES, IOI_PLACES,
                     IOI_OBJECTS)


def _ioi_docs(task: str, seed: int, n: int, names: Sequence[str], templates: Sequence[str],
              places: Sequence[str], objects: Sequence[str]) -> list[dict[str, Any]]:
    """An IOI task's docs from its words (``make_ioi_docs``' rules; ``task`` seeds it)."""
    if n % 2:
        raise ValueError(f"n={n} must be even so that the answer is the first name in half")
    rng = random.Random(f"{task}:{seed}")
    labels = [0] * (n // 2) + [1] * (n // 2)
    rng.shuffle(labels)
    docs = []
    for i, label in enumerate(labels):
        a, b = rng.sample(names, 2)
        template = rng.choice(templates)
        place, obj = rng.choice(places), rng.choice(objects)
        subject = b if label == 0 else a  # the repeated name; the answer is the other one
        docs.append({
            "id": i,
            "context": template.format(a=a, b=b, s=subject, place=place, obj=obj),
            "choices": [a, b],
            "label": label,
        })
    return docs


def make_arith_docs(seed: int = SEED, n_repeats: int = ARITH_REPEATS) -> list[dict[str, Any]]:
    """Docs for ``headloc_arith``: few-shot ``a + b =`` for every single-digit pair.

    Every (a, b) in 0..9 x 0..9 appears ``n_repeats`` times, each time after different
    solved examples, so the answer distribution is fixed (9 is the most frequent, 10 %).
    The examples never show the question's own pair (in either order), so copying from
    the context cannot answer it. ``target`` ends with the newline that ends every
    example line, so answering 1 when the model means 10 is not counted as right, and
    starts with a space like the induction target.
    """
    rng = random.Random(f"headloc_arith:{seed}")
    pairs = [(a, b) for a in range(10) for b in range(10)] * n_repeats
    rng.shuffle(pairs)
    docs = []
    for i, (a, b) in enumerate(pairs):
        others = [p for p in set(pairs) if p not in ((a, b), (b, a))]
        shots = rng.sample(sorted(others), ARITH_SHOTS)
        lines = [f"{x} + {y} = {x + y}" for x, y in shots] + [f"{a} + {b} ="]
        docs.append({
            "id": i,
            "a": a,
            "b": b,
            "answer": a + b,
            "context": "\n".join(lines),
            "target": f" {a + b}\n",
        })
    return docs


def make_heldout_successor_docs(seed: int = SEED) -> list[dict[str, Any]]:
    """Docs for ``heldout_successor``: a sequence's header and a run of its items; ``target``
    is the next item.

    Every run of :data:`SUCCESSOR_RUN_LEN` consecutive items of every sequence in
    :data:`SUCCESSOR_SEQUENCES` is asked once (days and months wrap around, the others
    stop at their last item), in an order shuffled by ``seed``: 266 docs, none twice.
    ``context`` is ``"Days: Monday, Tuesday,"``, ``target`` ``" Wednesday"``, with its
    leading space as in ``headloc_induction``. Without the header and the commas the
    embedded SmolLM2 continues the run with punctuation, not with the next item.
    """
    runs = []
    for name, (_, items, wraps) in SUCCESSOR_SEQUENCES.items():
        for length in range(SUCCESSOR_RUN_LEN[0], SUCCESSOR_RUN_LEN[1] + 1):
            starts = len(items) if wraps else len(items) - length
            runs += [(name, start, length) for start in range(starts)]
    rng = random.Random(f"heldout_successor:{seed}")
    rng.shuffle(runs)
    docs = []
    for i, (name, start, length) in enumerate(runs):
        header, items, _ = SUCCESSOR_SEQUENCES[name]
        run = [items[(start + j) % len(items)] for j in range(length + 1)]
        docs.append({
            "id": i,
            "sequence": name,
            "shown": run[:-1],
            "context": f"{header}: " + ", ".join(run[:-1]) + ",",
            "target": " " + run[-1],
        })
    return docs


def make_heldout_ioi_b_docs(seed: int = SEED, n: int = N_DOCS) -> list[dict[str, Any]]:
    """Docs for ``heldout_ioi_b``: ``headloc_ioi``'s question in other words.

    As :func:`make_ioi_docs` (``choices`` the names in order of mention, ``label`` the
    answer's index, exactly half the docs answered by the first name), but with
    :data:`HELDOUT_IOI_TEMPLATES`, :data:`HELDOUT_NAMES` and places and objects that
    ``headloc_ioi`` does not use.
    """
    return _ioi_docs("heldout_ioi_b", seed, n, HELDOUT_NAMES, HELDOUT_IOI_TEMPLATES,
                     HELDOUT_IOI_PLACES, HELDOUT_IOI_OBJECTS)


def make_heldout_kv_recall_docs(seed: int = SEED, n: int = N_DOCS) -> list[dict[str, Any]]:
    """Docs for ``heldout_kv_recall``: ``key: value`` lines, then two keys asked again.

    :data:`KV_PAIRS` lines pair distinct common words (no word is both a key and a value);
    after a blank line one key is asked and answered (``demo``, which shows the format),
    then another (``query``) is asked: ``target`` is its value, with its leading space.
    Without the answered example the embedded SmolLM2 answers a quarter of them.
    """
    rng = random.Random(f"heldout_kv_recall:{seed}")
    docs = []
    for i in range(n):
        count = rng.randint(*KV_PAIRS)
        words = rng.sample(COMMON_WORDS, 2 * count)
        keys, values = words[:count], words[count:]
        demo, query = rng.sample(range(count), 2)
        lines = [f"{k}: {v}" for k, v in zip(keys, values, strict=True)]
        docs.append({
            "id": i,
            "keys": keys,
            "values": values,
            "demo": demo,
            "query": query,
            "context": "\n".join(lines) + f"\n\n{lines[demo]}\n{keys[query]}:",
            "target": " " + values[query],
        })
    return docs


GENERATORS: dict[str, Callable[[int], list[dict[str, Any]]]] = {
    "headloc_induction": make_induction_docs,
    "headloc_ioi": make_ioi_docs,
    "headloc_arith": make_arith_docs,
    "heldout_successor": make_heldout_successor_docs,
    "heldout_ioi_b": make_heldout_ioi_b_docs,
    "heldout_kv_recall": make_heldout_kv_recall_docs,
}


def _majority_share(values: Iterable[Any]) -> float:
    counts = Counter(values)
    return max(counts.values()) / sum(counts.values())


def chance_accuracy(task: str, docs: Sequence[dict[str, Any]]) -> float:
    """Accuracy of the best trivial predictor on these docs (the bar a baseline must clear).

    - induction: the better of always answering the most frequent target and guessing
      uniformly among the words of the sequence;
    - ioi: always picking the same position (first or second name);
    - arith: always answering the most frequent sum;
    - successor: the better of always answering the most frequent target and guessing
      uniformly among the sequence's items that the run does not show;
    - kv_recall: the better of always answering the most frequent target and guessing
      uniformly among the values other than the one answered in the context.
    """
    if not docs:
        raise ValueError("no docs")
    if task == "headloc_induction":
        uniform = sum(1 / len(set(d["words"])) for d in docs) / len(docs)
        return max(uniform, _majority_share(d["target"] for d in docs))
    if task in ("headloc_ioi", "heldout_ioi_b"):
        return _majority_share(d["label"] for d in docs)
    if task == "headloc_arith":
        return _majority_share(d["answer"] for d in docs)
    if task == "heldout_successor":
        unseen = [len(SUCCESSOR_SEQUENCES[d["sequence"]][1]) - len(d["shown"]) for d in docs]
        uniform = sum(1 / u for u in unseen) / len(docs)
        return max(uniform, _majority_share(d["target"] for d in docs))
    if task == "heldout_kv_recall":
        uniform = sum(1 / (len(d["values"]) - 1) for d in docs) / len(docs)
        return max(uniform, _majority_share(d["target"] for d in docs))
    raise ValueError(f"unknown task {task!r}; known: {', '.join(GENERATORS)}")


def docs_to_jsonl(docs: Iterable[dict[str, Any]]) -> str:
    """One JSON object a line, in a fixed form so the same docs give the same bytes."""
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)


def data_file(task_configs: str | Path, task: str) -> Path:
    """Where a task's data file lives under a ``task_configs`` folder."""
    return Path(task_configs) / task / f"{task}.jsonl"


def _refusal(task_configs: str | Path) -> str | None:
    """Why ``write_task_data`` may not write under ``task_configs``, None where it may:
    each folder on the way is a folder (or missing: made), each data file a regular file
    (rewritten) or missing. Nothing that is not a folder or a data file is replaced."""
    for task in GENERATORS:
        path = data_file(task_configs, task)
        # The nearest folder on the way that is there (a file there was NotADirectoryError).
        there = next(f for f in (path.parent, *path.parent.parents) if os.path.lexists(f))
        if not there.is_dir():
            return f"{there} is not a folder"
        if (what := not_a_file(path)) is not None or path.is_dir():
            return what or f"{path} is a folder, not a data file"
    return None


def write_task_data(task_configs: str | Path, seed: int = SEED) -> list[Path]:
    """(Re)write every task's JSONL under ``task_configs``; returns the files written.
    Checked for every file before any is written: a ``UsageError`` naming the path."""
    if (why := _refusal(task_configs)) is not None:
        raise UsageError(f"--out {task_configs}: {why}; name the task_configs folder (made "
                         "where missing)")
    written = []
    for task, generate in GENERATORS.items():
        path = data_file(task_configs, task)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(docs_to_jsonl(generate(seed)).encode("utf-8"))
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lm_eval_headloc.tasks.generators",
        description="Write the data files of the offline capability tasks "
        "(headloc_* and the held-out heldout_*).",
    )
    parser.add_argument("--out", required=True, help="the task_configs folder")
    parser.add_argument("--seed", type=int, default=SEED, help=f"default {SEED} (committed)")
    args = parser.parse_args(argv)
    try:
        written = write_task_data(args.out, args.seed)
    except UsageError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    try:
        for path in written:
            print(path)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped (`| head -1`): quiet, as Unix tools are. stdout then goes to
        # devnull, else the flush at exit fails again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
