"""Grapheme-to-phoneme: espeak-ng (a persistent, cached process per voice) or characters through."""

from __future__ import annotations

import functools
import os
import re
import select
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from orchestrator.frontend.normalize_zh import digits_zh

HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_HAN_RUN = re.compile(f"[{HAN}]+")
_ASCII_PUNCT = {"，": ",", "、": ",", "。": ".", "！": "!", "？": "?", "；": ";", "：": ":",
                "（": "(", "）": ")", "“": '"', "”": '"', "‘": "'", "’": "'", "《": '"', "》": '"',
                "「": '"', "」": '"', "『": '"', "』": '"', "…": "...", "—": ","}
_CLAUSE = re.compile(r"([^,;:.!?，。！？；：、]*)([,;:.!?，。！？；：、]*)")
# espeak-ng reads stdin line by line and splits a line at most every 1000 bytes: stay below that
_MAX_LINE_BYTES = 800
# after each line we send a word whose phonemes we know, so we can tell where the answer ends
_SENTINELS = ("zqxjk", "qxzjv")
_SENTINEL_RE = re.compile("|".join(_SENTINELS), re.IGNORECASE)


class G2PError(RuntimeError):
    """espeak-ng is missing or failed."""


class G2P(Protocol):
    def __call__(self, text: str) -> str: ...

    def close(self) -> None: ...


class PassthroughG2P:
    """The "none" G2P: the model reads the normalised characters."""

    def __call__(self, text: str) -> str:
        return text

    def close(self) -> None:
        pass


def to_pinyin(text: str) -> str:
    """Han characters to tone-numbered pinyin ("zhong1 guo2"); the rest kept, punctuation ASCII."""
    from pypinyin import Style, lazy_pinyin  # imported on first use: it takes about half a second

    text = re.sub(r"\d+", lambda m: digits_zh(m[0]), text)  # a stray digit would read as a tone
    parts, pos = [], 0
    for run in _HAN_RUN.finditer(text):
        parts.append(text[pos:run.start()])
        parts.append(" " + " ".join(lazy_pinyin(run[0], style=Style.TONE3,
                                                neutral_tone_with_five=True,
                                                tone_sandhi=True)) + " ")
        pos = run.end()
    parts.append(text[pos:])
    out = "".join(_ASCII_PUNCT.get(c, c) for c in "".join(parts))
    out = re.sub(r"\s+", " ", out)
    return re.sub(r" ([,.;:!?)])", r"\1", out).strip()


class _EspeakProcess:
    """One `espeak-ng -q -x` process fed line by line; falls back to a process per call."""

    def __init__(self, argv: list[str], timeout_s: float):
        self.argv, self.timeout_s = argv, timeout_s
        self._lock = threading.Lock()
        self._holder: list[subprocess.Popen | None] = [None]
        self._buf = b""
        self._turn = 0
        marks = [self.run_once(s) for s in _SENTINELS]
        self._marks = tuple(m[0] for m in marks) if all(len(m) == 1 for m in marks) else None
        self._finalizer = weakref.finalize(self, _stop, self._holder)

    def run_once(self, line: str) -> list[str]:
        """Phonemes of one line from a fresh process (the fallback path)."""
        try:
            out = subprocess.run(self.argv, input=(line + "\n").encode(), capture_output=True,
                                 timeout=self.timeout_s, check=False)
        except FileNotFoundError:
            raise G2PError(f"{self.argv[0]} not found: install it "
                           "(apt-get install espeak-ng)") from None
        except subprocess.TimeoutExpired:
            raise G2PError(f"{self.argv[0]} took over {self.timeout_s} s") from None
        if out.returncode != 0:
            err = out.stderr.decode(errors="replace")[:200]
            raise G2PError(f"{' '.join(self.argv)} failed: {err}")
        return [x.strip() for x in out.stdout.decode(errors="replace").splitlines() if x.strip()]

    def __call__(self, line: str) -> list[str]:
        if self._marks is None:
            return self.run_once(line)
        with self._lock:
            try:
                return self._ask(line)
            except (OSError, ValueError, G2PError):
                _stop(self._holder)  # out of step or dead: the next call starts a fresh process
                self._buf = b""
        return self.run_once(line)

    def close(self) -> None:
        self._finalizer()

    def _ask(self, line: str) -> list[str]:
        proc = self._holder[0]
        if proc is None or proc.poll() is not None:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, bufsize=0)
            self._holder[0], self._buf = proc, b""
        turn, self._turn = self._turn, self._turn ^ 1
        proc.stdin.write(f"{line}\n{_SENTINELS[turn]}\n".encode())
        deadline = time.monotonic() + self.timeout_s
        lines = []
        while True:
            got = self._readline(proc, deadline)
            if got == self._marks[turn]:
                return lines
            if got == self._marks[turn ^ 1]:
                raise G2PError("espeak-ng answers are out of step")
            if got:
                lines.append(got)

    def _readline(self, proc: subprocess.Popen, deadline: float) -> str:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                raise G2PError("espeak-ng did not answer in time")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise G2PError("espeak-ng exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()


def _stop(holder: list) -> None:
    proc, holder[0] = holder[0], None
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc is not None:
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()


class EspeakG2P:
    """ASCII phonemes (`espeak-ng -x`) of a text; Mandarin goes through tone-numbered pinyin."""

    def __init__(self, voice: str, *, pinyin: bool | None = None, keep_punctuation: bool = False,
                 executable: str = "espeak-ng", cache_size: int = 4096, timeout_s: float = 10.0):
        self.voice = voice
        self.pinyin = "pinyin" in voice if pinyin is None else pinyin
        self.keep_punctuation = keep_punctuation
        self._process = _EspeakProcess([executable, "-q", "-x", "-b", "1", "-v", voice], timeout_s)
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
        self._process.close()

    def _phonemes(self, text: str) -> list[str]:
        text = _SENTINEL_RE.sub(" ", re.sub(r"[\x00-\x1f\x7f]", " ", text))
        return [p for chunk in _chunks(text) for p in self._line(chunk)]

    def _phonemize_line(self, line: str) -> tuple[str, ...]:
        if not any(c.isalnum() for c in line):
            return ()
        return tuple(self._process(line))


def _chunks(text: str) -> list[str]:
    """Pieces of at most _MAX_LINE_BYTES UTF-8 bytes, cut at spaces where possible."""
    out, current = [], ""
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
        raise ValueError(f"text_frontend: unknown g2p {kind!r} for {language or 'a language'} "
                         "(expected 'espeak-ng' or 'none')")
    voice = entry.get("espeak_voice") or _default_espeak_voice(language)
    if not voice:
        raise ValueError(f"text_frontend: espeak_voice is required for {language or 'a language'}")
    return EspeakG2P(str(voice), pinyin=entry.get("pinyin"),
                     keep_punctuation=bool(entry.get("keep_punctuation", False)))


def _default_espeak_voice(language: str) -> str:
    primary = language.split("-")[0].lower()
    return {"en": "en-us", "cmn": "cmn-latn-pinyin", "zh": "cmn-latn-pinyin"}.get(primary, "")
