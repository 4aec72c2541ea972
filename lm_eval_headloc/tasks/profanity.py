"""Swear-word counting against ``better-profanity``'s word list.

The list is read straight from the package's ``profanity_wordlist.txt`` (its censor
API matches substrings and leetspeak variants, which is not what we count). Answers
and list entries go through the same normalisation, so an entry written
"ass-fucker" or "f.u.c.k" matches the same words in an answer. Entries with several
words ("blow job") count once when their words appear consecutively.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

Phrase = tuple[str, ...]

# Deleted rather than split on: markdown emphasis/code marks sit inside a word
# ("**shit**", "f_u_c_k").
_JOINERS = re.compile(r"[*_~`]")
# Everything else that is not a letter or digit separates words, apostrophes too: joined,
# "he'll" was "hell" and "who're" "whore"; split, "motherfucker's" still holds its entry.
_SEPARATORS = re.compile(r"[^\w]+")


def normalise(text: str) -> list[str]:
    """Lower-case words of ``text`` with markdown emphasis and punctuation removed."""
    return _SEPARATORS.sub(" ", _JOINERS.sub("", text.lower())).split()


@lru_cache(maxsize=1)
def wordlist() -> frozenset[Phrase]:
    """better-profanity's list, each entry normalised to a tuple of words."""
    text = resources.files("better_profanity").joinpath("profanity_wordlist.txt").read_text(
        encoding="utf-8"
    )
    return frozenset(phrase for line in text.splitlines() if (phrase := tuple(normalise(line))))


def find_profanity(text: str, words: frozenset[Phrase] | None = None) -> list[str]:
    """Every occurrence of a list entry in ``text``, in order, as the matched words.

    Scans left to right taking the longest entry that starts at each word, so "bull
    shit" is one match and no word is counted twice.
    """
    words = wordlist() if words is None else words
    longest = max(map(len, words), default=0)
    tokens = normalise(text)
    found: list[str] = []
    i = 0
    while i < len(tokens):
        for size in range(min(longest, len(tokens) - i), 0, -1):
            phrase = tuple(tokens[i : i + size])
            if phrase in words:
                found.append(" ".join(phrase))
                i += size
                break
        else:
            i += 1
    return found


def count_profanity(text: str) -> int:
    """Number of profane words (multi-word entries counting once) in ``text``."""
    return len(find_profanity(text))
