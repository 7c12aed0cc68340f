"""Teacher speech with phone timings: flite `slt` (English) and espeak-ng's library (Mandarin).

The LM's input is espeak-ng's ASCII phoneme string (`-x`), one character per token. Each
teacher phone is aligned onto that string by a small dynamic programme so every character gets
a duration in speech tokens; the LM then learns interleaved `char tokens... char tokens...`.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 22050
# characters that carry no sound of their own: skipping them is free
MODIFIERS = set("',:#;|_ -0123456789[].%=!^?")
# characters a phone's tokens move past, so they follow e.g. tone digits and length marks
ATTACHED = set("0123456789:#;")

_ARPABET = {
    "aa": "Aa0:",
    "ae": "a&",
    "ah": "V@a",
    "ao": "O0:A",
    "aw": "aU",
    "ax": "@aI3V",
    "axr": "3@r",
    "ay": "aI",
    "eh": "Ee",
    "er": "3:@r",
    "ey": "eI",
    "ih": "Ii#@e",
    "iy": "i:",
    "ow": "oUO",
    "oy": "OI",
    "uh": "Uu",
    "uw": "u:",
    "b": "b",
    "ch": "tS",
    "d": "dt",
    "dh": "D",
    "f": "f",
    "g": "g",
    "hh": "h",
    "jh": "dZ",
    "k": "k",
    "l": "l",
    "m": "m",
    "n": "n",
    "ng": "Nn",
    "p": "p",
    "r": "r3",
    "s": "s",
    "sh": "S",
    "t": "td#",
    "th": "T",
    "v": "v",
    "w": "w",
    "y": "j",
    "z": "z",
    "zh": "Z",
    "pau": " |_",
}


@dataclass
class Utterance:
    """One teacher sentence: phoneme string, per-character token durations and log-mel."""

    text: str
    phonemes: str
    durations: np.ndarray  # [len(phonemes)] speech tokens after each character
    mel: np.ndarray  # [80, frames] float16


class EspeakLib:
    """espeak-ng through its C library: phoneme strings and synthesis with phone events."""

    def __init__(self) -> None:
        class Event(ctypes.Structure):
            _fields_ = [
                ("type", ctypes.c_int),
                ("uid", ctypes.c_uint),
                ("text_position", ctypes.c_int),
                ("length", ctypes.c_int),
                ("audio_position", ctypes.c_int),
                ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p),
                ("id", ctypes.c_char * 8),
            ]

        self.lib = ctypes.CDLL("libespeak-ng.so.1")
        callback_type = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(Event)
        )
        if self.lib.espeak_Initialize(2, 0, None, 1) != SAMPLE_RATE:  # synchronous, phoneme events
            raise RuntimeError("espeak-ng does not synthesise at 22050 Hz")
        self._chunks: list[np.ndarray] = []
        self._events: list[tuple[str, int]] = []

        def on_audio(wav, n, events):
            if n > 0:
                self._chunks.append(np.ctypeslib.as_array(wav, (n,)).copy())
            i = 0
            while events[i].type != 0:
                if events[i].type == 7:  # phoneme
                    self._events.append((events[i].id.decode(errors="replace"), events[i].sample))
                i += 1
            return 0

        self._callback = callback_type(on_audio)
        self.lib.espeak_SetSynthCallback(self._callback)
        self.lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        self._voice = ""

    def set_voice(self, voice: str) -> None:
        if voice != self._voice:
            if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise RuntimeError(f"espeak-ng has no voice {voice}")
            self._voice = voice

    def phonemes(self, text: str, voice: str) -> str:
        """What `espeak-ng -q -x -v voice text` prints: one line per clause."""
        self.set_voice(voice)
        buf = ctypes.c_char_p(text.encode())
        ptr = ctypes.pointer(buf)
        lines = []
        while buf.value:
            lines.append(self.lib.espeak_TextToPhonemes(ptr, 1, 0).decode())
        return "\n".join(line.strip() for line in lines if line.strip())

    def synth(self, text: str, voice: str) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
        """Audio float32 at 22050 Hz and phones as (name, start sample, end sample)."""
        self.set_voice(voice)
        self._chunks, self._events = [], []
        data = text.encode()
        self.lib.espeak_Synth(data, len(data) + 1, 0, 1, 0, 1, None, None)
        self.lib.espeak_Synchronize()
        audio = np.concatenate(self._chunks).astype(np.float32) / 32768.0
        ev = self._events
        phones = [
            (name, s, ev[i + 1][1] if i + 1 < len(ev) else len(audio))
            for i, (name, s) in enumerate(ev)
        ]
        return audio, phones


def flite_synth(text: str) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    """flite `slt` audio resampled to 22050 Hz and its segments as (name, start, end) samples."""
    import soundfile as sf
    import soxr

    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "a.wav"
        out = subprocess.run(
            ["flite", "-voice", "slt", "-psdur", "-t", text, "-o", str(wav)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        audio, sr = sf.read(str(wav), dtype="float32")
    audio = soxr.resample(audio, sr, SAMPLE_RATE).astype(np.float32)
    phones, prev = [], 0
    for item in out.split():
        name, end = item.rsplit(":", 1)
        end_s = min(int(round(float(end) * SAMPLE_RATE)), len(audio))
        phones.append((name, prev, end_s))
        prev = end_s
    return audio, phones


def _is_pause(name: str) -> bool:
    return name == "pau" or name.startswith("_")


def align(phones: list[tuple[str, int, int]], units: str, arpabet: bool) -> list[int]:
    """For each phone, the index of the unit character that carries its duration (-1: none)."""
    n, m, span_max = len(phones), len(units), 6
    sets = [set(_ARPABET.get(p, p)) if arpabet else set(p) for p, _, _ in phones]
    skip_char = [0.0 if c in MODIFIERS else 1.0 for c in units]
    inf = float("inf")
    cost = np.full((n + 1, m + 1), inf)
    back: dict[tuple[int, int], tuple[int, int, str]] = {}
    cost[0, 0] = 0.0
    for i in range(n + 1):
        for j in range(m + 1):
            c = cost[i, j]
            if c == inf:
                continue
            if j < m and c + skip_char[j] < cost[i, j + 1]:
                cost[i, j + 1] = c + skip_char[j]
                back[i, j + 1] = (i, j, "skip_char")
            if i < n:
                pc = 0.2 if _is_pause(phones[i][0]) else 1.0
                if c + pc < cost[i + 1, j]:
                    cost[i + 1, j] = c + pc
                    back[i + 1, j] = (i, j, "skip_phone")
                acc = c
                for k in range(j, min(m, j + span_max)):
                    ch = units[k]
                    acc += 0.0 if (ch in sets[i] or ch in MODIFIERS) else 1.0
                    if ch in sets[i]:
                        acc -= 0.01  # prefer real matches over free skips
                    if acc < cost[i + 1, k + 1]:
                        cost[i + 1, k + 1] = acc
                        back[i + 1, k + 1] = (i, j, "span")
    owner = [-1] * n
    i, j = n, m
    while (i, j) != (0, 0):
        pi, pj, op = back[i, j]
        if op == "span":
            owner[pi] = j - 1
        i, j = pi, pj
    return owner


def durations_for(
    phones: list[tuple[str, int, int]],
    units: str,
    start: int,
    num_tokens: int,
    arpabet: bool,
    samples_per_token: int,
) -> np.ndarray:
    """Speech tokens after each unit character, summing to `num_tokens`."""
    owner = align(phones, units, arpabet)
    # fill phones without a character from the previous (else next) owned one
    last = next((o for o in owner if o >= 0), 0)
    for i, o in enumerate(owner):
        if o < 0:
            owner[i] = last
        last = owner[i]
    # a character owns the end of its last phone: cumulative rounding keeps the total exact
    ends = np.zeros(len(units), dtype=np.int64)
    has = np.zeros(len(units), dtype=bool)
    for (_, _, end), o in zip(phones, owner):
        ends[o] = max(ends[o], end)
        has[o] = True
    durations = np.zeros(len(units), dtype=np.int64)
    prev = 0
    for k in range(len(units)):
        if has[k]:
            b = int(np.clip(round((ends[k] - start) / samples_per_token), prev, num_tokens))
            durations[k] = b - prev
            prev = b
    last_owned = int(np.flatnonzero(has)[-1]) if has.any() else len(units) - 1
    durations[last_owned] += num_tokens - prev
    # move tokens past tone digits and length marks so they follow the whole phoneme
    for k in range(len(units) - 1):
        if durations[k] and units[k + 1] in ATTACHED:
            durations[k + 1] += durations[k]
            durations[k] = 0
    return durations


def trim_bounds(phones: list[tuple[str, int, int]], length: int) -> tuple[int, int]:
    """Audio span from just before the first sounding phone to just after the last one."""
    sounding = [(s, e) for name, s, e in phones if not _is_pause(name)]
    if not sounding:
        return 0, length
    return max(0, sounding[0][0] - int(0.04 * SAMPLE_RATE)), min(
        length, sounding[-1][1] + int(0.08 * SAMPLE_RATE)
    )
