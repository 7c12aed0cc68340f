"""Grapheme-to-phoneme: espeak-ng (in process, cached per voice) or characters through."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from orchestrator.frontend.espeak_lib import EspeakLibrary, EspeakLibraryError
from orchestrator.frontend.normalize_zh import digits_zh

HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_HAN_RUN = re.compile(f"[{HAN}]+")
_ASCII_PUNCT = {
    "，": ",",
    "、": ",",
    "。": ".",
    "！": "!",
    "？": "?",
    "；": ";",
    "：": ":",
    "（": "(",
    "）": ")",
    "“": '"',
    "”": '"',
    "‘": "'",
    "’": "'",
    "《": '"',
    "》": '"',
    "「": '"',
    "」": '"',
    "『": '"',
    "』": '"',
    "…": "...",
    "—": ",",
}
_CLAUSE = re.compile(r"([^,;:.!?，。！？；：、]*)([,;:.!?，。！？；：、]*)")
# the voices were made from espeak-ng's CLI, which splits a line at most every 1000 bytes:
# feed it pieces below that, as the CLI was fed
_MAX_LINE_BYTES = 800


class G2PError(RuntimeError):
    """espeak-ng is missing or failed."""


LinePhonemizer = Callable[[str, str], list[str]]  # (line, voice) -> the `-x` lines espeak prints


class G2P(Protocol):
    def __call__(self, text: str) -> str: ...

    def close(self) -> None: ...


class PassthroughG2P:
    """The "none" G2P: the model reads the normalised characters."""

    def __call__(self, text: str) -> str:
        return text

    def close(self) -> None:
        pass


def load_pinyin() -> None:
    """Import pypinyin and load its dictionaries now (about half a second), not on first use."""
    to_pinyin("中文")


def to_pinyin(text: str) -> str:
    """Han characters to tone-numbered pinyin ("zhong1 guo2"); the rest kept, punctuation ASCII."""
    from pypinyin import Style, lazy_pinyin  # imported on first use: it takes about half a second

    text = re.sub(r"\d+", lambda m: digits_zh(m[0]), text)  # a stray digit would read as a tone
    parts, pos = [], 0
    for run in _HAN_RUN.finditer(text):
        parts.append(text[pos : run.start()])
        parts.append(
            " "
            + " ".join(
                lazy_pinyin(
                    run[0], style=Style.TONE3, neutral_tone_with_five=True, tone_sandhi=True
                )
            )
            + " "
        )
        pos = run.end()
    parts.append(text[pos:])
    out = "".join(_ASCII_PUNCT.get(c, c) for c in "".join(parts))
    out = re.sub(r"\s+", " ", out)
    return re.sub(r" ([,.;:!?)])", r"\1", out).strip()


class EspeakG2P:
    """ASCII phonemes (`espeak-ng -x`) of a text; Mandarin goes through tone-numbered pinyin."""

    def __init__(
        self,
        voice: str,
        *,
        pinyin: bool | None = None,
        keep_punctuation: bool = False,
        cache_size: int = 4096,
        phonemize: LinePhonemizer | None = None,
    ):
        self.voice = voice
        self.pinyin = "pinyin" in voice if pinyin is None else pinyin
        self.keep_punctuation = keep_punctuation
        if phonemize is None:
            try:
                library = EspeakLibrary.shared()
                library.check_voice(voice)
            except EspeakLibraryError as exc:
                raise G2PError(str(exc)) from None
            phonemize = library.phonemes
        self._phonemize = phonemize
        self._line = functools.lru_cache(maxsize=cache_size)(self._phonemize_line)

    def __call__(self, text: str) -> str:
        text = to_pinyin(text) if self.pinyin else text
        if not self.keep_punctuation:
            return " ".join(self._phonemes(text))
        out = []
        for clause, punct in _CLAUSE.findall(text):
            said = " ".join(self._phonemes(clause + punct))
            mark = _ASCII_PUNCT.get(punct[:1], punct[:1])
            if said:
                out.append(said + mark)
            elif mark and out and out[-1][-1:] not in ",;:.!?":
                out[-1] += mark
        return " ".join(out)

    def close(self) -> None:
        """Nothing to stop: the library is shared by the process."""

    def _phonemes(self, text: str) -> list[str]:
        text = re.sub(r"[\x00-\x1f\x7f]", " ", text)
        return [p for chunk in _chunks(text) for p in self._line(chunk)]

    def _phonemize_line(self, line: str) -> tuple[str, ...]:
        if not any(c.isalnum() for c in line):
            return ()
        try:
            return tuple(self._phonemize(line, self.voice))
        except EspeakLibraryError as exc:
            raise G2PError(str(exc)) from None


def _chunks(text: str) -> list[str]:
    """Pieces of at most _MAX_LINE_BYTES UTF-8 bytes, cut at spaces where possible."""
    out: list[str] = []
    current = ""
    for word in text.split():
        while len(word.encode()) > _MAX_LINE_BYTES:
            cut = _MAX_LINE_BYTES // 4  # characters take at most 4 bytes
            out, word = out + [word[:cut]], word[cut:]
        candidate = f"{current} {word}".strip()
        if len(candidate.encode()) > _MAX_LINE_BYTES:
            out.append(current)
            candidate = word
        current = candidate
    return out + [current] if current else out


def build_g2p(entry: Mapping[str, Any], language: str = "") -> G2P:
    """The G2P a voice manifest's `text_frontend` entry asks for ("espeak-ng" or "none")."""
    kind = str(entry.get("g2p", "none")).lower()
    if kind in ("none", "characters", ""):
        return PassthroughG2P()
    if kind not in ("espeak-ng", "espeak"):
        raise ValueError(
            f"text_frontend: unknown g2p {kind!r} for {language or 'a language'} "
            "(expected 'espeak-ng' or 'none')"
        )
    voice = entry.get("espeak_voice") or _default_espeak_voice(language)
    if not voice:
        raise ValueError(f"text_frontend: espeak_voice is required for {language or 'a language'}")
    return EspeakG2P(
        str(voice),
        pinyin=entry.get("pinyin"),
        keep_punctuation=bool(entry.get("keep_punctuation", False)),
    )


def _default_espeak_voice(language: str) -> str:
    primary = language.split("-")[0].lower()
    return {"en": "en-us", "cmn": "cmn-latn-pinyin", "zh": "cmn-latn-pinyin"}.get(primary, "")
