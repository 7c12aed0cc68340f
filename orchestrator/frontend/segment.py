"""Sentence and clause segmentation, whole-text and incremental (for StreamingSynthesize).

Lengths are in Latin-character units: a CJK character counts as 3, about one syllable of speech.
"""

from __future__ import annotations

import re

_CJK_END = "。！？｡"
_END = ".!?…．" + _CJK_END
_CLOSERS = "\"')]}’”」』）》】"
_CJK_CLAUSE = "，、；："
_CLAUSE = ",;:—"
_WIDE = re.compile(r"[\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef\u3000-\u303f]")
# titles and the like that a full stop never ends
_NEVER_FINAL = {
    "mr",
    "mrs",
    "ms",
    "dr",
    "prof",
    "st",
    "mt",
    "gen",
    "sen",
    "rep",
    "gov",
    "capt",
    "lt",
    "sgt",
    "rev",
    "vs",
    "e.g",
    "i.e",
    "cf",
    "fig",
    "ca",
    "jan",
    "feb",
    "mar",
    "apr",
    "jun",
    "jul",
    "aug",
    "sep",
    "sept",
    "oct",
    "nov",
    "dec",
}
# abbreviations that may also end a sentence: the word after them decides
_MAYBE_FINAL = {
    "etc",
    "jr",
    "sr",
    "inc",
    "ltd",
    "co",
    "corp",
    "no",
    "al",
    "vol",
    "ed",
    "pp",
    "approx",
    "dept",
    "est",
    "misc",
}
_WORD_BEFORE = re.compile(r"([A-Za-z][A-Za-z.]*)$")


def text_units(text: str) -> int:
    """Length in Latin-character units (a CJK character counts 3)."""
    return len(text) + 2 * len(_WIDE.findall(text))


def _sentence_end(text: str, i: int, final: bool, english: bool) -> int | None | bool:
    """For a terminator at i: the cut index, False if it is no boundary, None if unknown yet."""
    j = i + 1
    while j < len(text) and text[j] in _END:
        j += 1
    while j < len(text) and text[j] in _CLOSERS:
        j += 1
    if j == len(text):
        return j if final else None  # a closing quote or "!" may follow
    if any(c in _CJK_END for c in text[i:j]):
        return j
    if not (text[j].isspace() or _WIDE.match(text[j])):
        return False  # "3.14", "e.g.x", "Yahoo!com"
    run = text[i:j].rstrip(_CLOSERS)
    if run not in (".", "...", "…", "．") or not english:
        return j
    word = _WORD_BEFORE.search(text[:i])
    token = word[1].lower() if word else ""
    initial = word and word[1] != "I" and re.fullmatch(r"(?:[A-Z]\.)*[A-Z]", word[1])
    if token in _NEVER_FINAL or initial:
        return False  # a title or an initial: "Dr. Smith", "J. R. R. Tolkien", "U.S. Army"
    if run == "." and token not in _MAYBE_FINAL and "." not in token:
        return j  # an ordinary word: the full stop ends the sentence
    k = j  # "etc.", "No.", "a.m.", "...": the next word decides
    while k < len(text) and text[k].isspace():
        k += 1
    if k == len(text):
        return j if final else None
    if text[k].islower() or (token == "no" and text[k].isdigit()):
        return False  # "approx. five", "No. 5", "wait... what"
    return j


def _boundaries(text: str, final: bool, english: bool):
    """(cut index, kind) in order, kind "sentence" or "clause"; stops where the text must grow."""
    i = 0
    while i < len(text):
        c = text[i]
        if c in _END and not (i > 0 and text[i - 1] in _END):  # judge a run like "?!" once
            cut = _sentence_end(text, i, final, english)
            if cut is None:
                return
            if cut is not False:
                yield cut, "sentence"
                i = cut
                continue
        elif c == "\n":
            j = i
            while j < len(text) and text[j].isspace():
                j += 1
            if j == len(text) and not final:
                return
            yield i, "sentence" if text[i:j].count("\n") > 1 or j == len(text) else "clause"
            i = j
            continue
        elif c in _CJK_CLAUSE:
            if i > 0 and text[i - 1].isdigit():  # "1，000" is one number
                if i + 1 == len(text) and not final:
                    return
                if i + 1 < len(text) and text[i + 1].isdigit():
                    i += 1
                    continue
            yield i + 1, "clause"
        elif c in _CLAUSE:
            if i + 1 == len(text):
                if final:
                    yield i + 1, "clause"
                return
            if text[i + 1].isspace() or c == "—":
                yield i + 1, "clause"
        i += 1


def _safe_cut(text: str, limit: int) -> int:
    """The last place within `limit` units that splits no word or number (else just `limit`)."""
    best, units = None, 0
    for i, c in enumerate(text):
        units += 3 if _WIDE.match(c) else 1
        if units > limit:
            return best or max(i, 1)  # a "word" this long is no word: cut it anyway
        if c.isspace() and i > 0:
            best = i
        elif i > 0 and _WIDE.match(c) and _WIDE.match(text[i - 1]):
            best = i
    return len(text)


def _uses_english_rules(language: str | None) -> bool:
    """English abbreviations apply to English and to Mandarin (which embeds English words)."""
    return not language or language.split("-")[0].lower() in ("en", "eng", "cmn", "zh")


class StreamingSegmenter:
    """Cuts text arriving in pieces into speakable segments as soon as each is complete."""

    def __init__(
        self, language: str | None = None, *, min_clause_chars: int = 40, max_chars: int = 250
    ):
        if min_clause_chars < 1 or max_chars < min_clause_chars:
            raise ValueError("need 1 <= min_clause_chars <= max_chars")
        self.language = language
        self.min_clause_chars = min_clause_chars
        self.max_chars = max_chars
        self._english = _uses_english_rules(language)
        self._pending = ""

    @property
    def pending(self) -> str:
        """Text received but not yet returned."""
        return self._pending

    def push(self, piece: str) -> list[str]:
        """Add a piece; return the segments it completed (a sentence, or a long enough clause)."""
        self._pending += piece
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """End of input: return whatever is left, split into segments."""
        out = self._drain(final=True)
        rest, self._pending = self._pending.strip(), ""
        return out + [rest] if rest else out

    def _drain(self, final: bool) -> list[str]:
        out = []
        while (cut := self._next_cut(final)) is not None:
            segment, self._pending = self._pending[:cut].strip(), self._pending[cut:].lstrip()
            if segment:
                out.append(segment)
        return out

    def _next_cut(self, final: bool) -> int | None:
        text, last_clause = self._pending, None
        for cut, kind in _boundaries(text, final, self._english):
            units = text_units(text[:cut])
            if units > self.max_chars:
                break
            if kind == "sentence" or units >= self.min_clause_chars:
                return cut
            last_clause = cut
        if text_units(text) <= self.max_chars:
            return None
        return last_clause or _safe_cut(text, self.max_chars)


def split_sentences(text: str, language: str | None = None, *, max_chars: int = 250) -> list[str]:
    """Sentences of a whole text in order; one longer than max_chars is cut at clauses or spaces."""
    segmenter = StreamingSegmenter(language, min_clause_chars=max_chars, max_chars=max_chars)
    return segmenter.push(text) + segmenter.flush()
