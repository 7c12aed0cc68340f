"""Word timings from phoneme-synchronous decoding: where each spoken word starts and ends.

The engine emits every phoneme character before its speech tokens, so the number of speech
tokens before phoneme k is the frame where it starts. Phoneme words (split at spaces and
clause breaks) are matched to the segment's spoken words by a small monotonic alignment:
espeak-ng joins some function words ("of the" -> one word) and a word may split in two.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_UNIT = re.compile(
    r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|[^\s\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+"
)
_MAX_GROUP = 3


@dataclass(frozen=True)
class WordSpan:
    """A spoken word and its span in speech tokens from the start of its segment."""

    word: str
    start: float
    end: float


def spoken_units(normalized: str) -> list[str]:
    """The words a listener hears: Latin words without edge punctuation, Han characters one by one."""
    units = []
    for m in _UNIT.finditer(normalized):
        u = (
            m[0]
            if _HAN.fullmatch(m[0])
            else m[0].strip(".,;:!?\"'()[]{}-…。，、；：！？“”‘’（）《》")
        )
        if u and any(c.isalnum() for c in u):
            units.append(u)
    return units


def phoneme_words(chars: str) -> list[tuple[int, int]]:
    """[first, last + 1) character ranges of the phoneme words in a phoneme string."""
    return [(m.start(), m.end()) for m in re.finditer(r"[^ \n]+", chars)]


def _weight(unit: str) -> float:
    return 3.0 if _HAN.fullmatch(unit) else float(len(unit))


def align(units: list[str], lengths: list[int]) -> list[tuple[int, int, int, int]]:
    """Monotonic groups (u0, u1, p0, p1): units[u0:u1] are spoken as phoneme words [p0, p1).

    One side of each group has one element, the other at most three; cost is how far the
    group's length ratio is from the sentence's.
    """
    n, m = len(units), len(lengths)
    if n == 0 or m == 0:
        return []
    w = [_weight(u) for u in units]
    scale = sum(lengths) / sum(w)
    cost = [[math.inf] * (m + 1) for _ in range(n + 1)]
    back: dict[tuple[int, int], tuple[int, int]] = {}
    cost[0][0] = 0.0
    for i in range(n + 1):
        for j in range(m + 1):
            c = cost[i][j]
            if c == math.inf:
                continue
            for a, b in (
                [(1, 1)]
                + [(1, k) for k in range(2, _MAX_GROUP + 1)]
                + [(k, 1) for k in range(2, _MAX_GROUP + 1)]
            ):
                if i + a > n or j + b > m:
                    continue
                ratio = sum(lengths[j : j + b]) / (scale * sum(w[i : i + a]))
                step = abs(math.log(ratio)) + (0.0 if a == b == 1 else 0.6)
                if c + step < cost[i + a][j + b]:
                    cost[i + a][j + b] = c + step
                    back[i + a, j + b] = (i, j)
    if cost[n][m] == math.inf:
        return [(0, n, 0, m)]  # too different to pair: one group
    groups, i, j = [], n, m
    while (i, j) != (0, 0):
        pi, pj = back[i, j]
        groups.append((pi, i, pj, j))
        i, j = pi, pj
    return groups[::-1]


def word_spans(
    normalized: str, phoneme_chars: str, phoneme_starts: list[int], num_tokens: int
) -> list[WordSpan]:
    """Spans of the spoken words of one segment, in speech tokens from its start.

    `phoneme_starts[k]`: speech tokens generated before phoneme character k (as many entries as
    characters were emitted); `num_tokens`: the segment's speech tokens in all.
    """
    units = spoken_units(normalized)
    words = phoneme_words(phoneme_chars)
    starts = list(phoneme_starts) + [num_tokens] * (len(phoneme_chars) + 1 - len(phoneme_starts))

    def at(k: int) -> float:
        return float(min(starts[k], num_tokens))

    out = []
    for u0, u1, p0, p1 in align(units, [b - a for a, b in words]):
        start, end = at(words[p0][0]), at(words[p1 - 1][1])
        weights = [_weight(u) for u in units[u0:u1]]
        total, acc = sum(weights), 0.0
        for unit, wt in zip(units[u0:u1], weights):  # a joined word's time split by length
            a = start + (end - start) * acc / total
            acc += wt
            out.append(WordSpan(unit, a, start + (end - start) * acc / total))
    return out
