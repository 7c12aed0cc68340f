"""Text front end: segmentation, normalisation and G2P for English and Mandarin."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.frontend.g2p import (
    G2P,
    HAN,
    EspeakG2P,
    G2PError,
    PassthroughG2P,
    build_g2p,
    to_pinyin,
)
from orchestrator.frontend.normalize_en import normalize_en
from orchestrator.frontend.normalize_zh import normalize_zh
from orchestrator.frontend.segment import StreamingSegmenter, split_sentences, text_units

__all__ = [
    "FrontEnd",
    "Segment",
    "StreamingSegmenter",
    "split_sentences",
    "detect_language",
    "normalize",
    "normalize_en",
    "normalize_zh",
    "build_g2p",
    "EspeakG2P",
    "PassthroughG2P",
    "G2P",
    "G2PError",
    "to_pinyin",
    "text_units",
    "primary_language",
]

_HAN_RE = re.compile(f"[{HAN}]")
_ALIASES = {"zh": "cmn", "zho": "cmn", "chi": "cmn", "cmn": "cmn", "en": "en", "eng": "en"}
_WARMUP = {"en": "Warm up 1, 2.", "cmn": "你好，1。"}


def detect_language(text: str) -> str:
    """ "cmn" when the text holds a Han character, else "en"."""
    return "cmn" if _HAN_RE.search(text) else "en"


def primary_language(code: str) -> str:
    """The primary subtag of a language code, with Chinese codes folded to "cmn"."""
    primary = code.replace("_", "-").split("-")[0].lower()
    return _ALIASES.get(primary, primary)


def normalize(text: str, language: str, *, phone_yao: bool = False) -> str:
    """Normalise text for a language: English or Mandarin rules; others only tidy whitespace."""
    primary = primary_language(language)
    if primary == "en":
        return normalize_en(text)
    if primary == "cmn":
        return normalize_zh(text, yao=phone_yao)
    return re.sub(r"\s+", " ", text).strip()


@dataclass(frozen=True)
class Segment:
    """One piece of text ready for the speech model, in the order it is spoken."""

    text: str  # the original text of the piece
    normalized: str  # numbers, dates, symbols... in words
    model_input: str  # what the prompt template's {text} receives: phonemes or characters
    language: str  # the language it was processed as (a text_frontend key where one matches)


@dataclass(frozen=True)
class _Language:
    key: str
    normalize: Callable[[str], str]
    g2p: G2P


class FrontEnd:
    """A voice's text front end, built from its manifest's `text_frontend` entry."""

    def __init__(
        self, config: Mapping[str, Mapping[str, Any]] | None = None, *, max_chars: int = 250
    ):
        self.max_chars = max_chars
        self._languages: dict[str, _Language] = {}
        self._unconfigured: dict[str, _Language] = {}
        try:
            for key, entry in (config or {}).items():
                if not isinstance(entry, Mapping):
                    raise ValueError(f"text_frontend[{key!r}] must be an object, got {entry!r}")
                self._languages[key] = self._build(key, entry)
        except Exception:
            self.close()
            raise

    @property
    def languages(self) -> tuple[str, ...]:
        """The languages the manifest configures."""
        return tuple(self._languages)

    def process(self, text: str, language: str = "") -> list[Segment]:
        """Sentences of `text` normalised and turned into model input; empty language = detect."""
        out = []
        for sentence in split_sentences(text, language or None, max_chars=self.max_chars):
            lang = self._resolve(language or detect_language(sentence))
            normalized = lang.normalize(sentence)
            if not any(c.isalnum() for c in normalized):
                continue  # "..." or a lone emoji: nothing to say
            model_input = lang.g2p(normalized).strip()
            if model_input:
                out.append(Segment(sentence, normalized, model_input, lang.key))
        return out

    def warmup(self) -> list[Segment]:
        """Run every language once, so voices, pypinyin and cn2an load now, not on a request;
        returns the segments it made (to warm what comes after the front end)."""
        return [
            segment
            for key in self._languages
            for segment in self.process(_WARMUP.get(primary_language(key), "Warm up."), key)
        ]

    def close(self) -> None:
        """Release the G2Ps."""
        for lang in self._languages.values():
            lang.g2p.close()

    def __enter__(self) -> FrontEnd:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self, key: str, entry: Mapping[str, Any]) -> _Language:
        phone_yao = bool(entry.get("phone_yao", False))
        if entry.get("normalize", True):

            def norm(text: str) -> str:
                return normalize(text, key, phone_yao=phone_yao)
        else:

            def norm(text: str) -> str:
                return re.sub(r"\s+", " ", text).strip()

        return _Language(key, norm, build_g2p(entry, key))

    def _resolve(self, language: str) -> _Language:
        for key, lang in self._languages.items():
            if key.lower() == language.lower():
                return lang
        primary = primary_language(language)
        for key, lang in self._languages.items():
            if primary_language(key) == primary:
                return lang
        # not configured: characters through, after the language's own normalisation
        if language not in self._unconfigured:
            self._unconfigured[language] = self._build(language, {"g2p": "none"})
        return self._unconfigured[language]
