"""espeak-ng in process: the `espeak-ng -q -x` phoneme trace through libespeak-ng and ctypes.

Why ctypes on the system library rather than a Python binding: the voice bundles were made
from the ASCII `-x` output of the system espeak-ng (Debian's 1.51), and that output is the
phoneme trace written while synthesising, after tone sandhi (Mandarin 214 -> 35) and language
switches. `espeak_TextToPhonemes`, which phonemizer and piper-phonemize wrap, stops before tone
processing, so its Mandarin differs; phonemizer's wrapper also asks for IPA, and espeakng-loader
and piper-phonemize bring their own espeak-ng build and data, whose phonemes need not match the
bundle's. Here the system library is driven the way the CLI drives it (same flags, same data),
so its answers are byte for byte those of `espeak-ng -q -x -b 1 -v VOICE`, with no process.

The library holds one global state and is not re-entrant: every call goes through one lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_PHONEMES = 0x100  # [[...]] in the text is phoneme input, as the CLI allows
_END_PAUSE = 0x1000  # a pause at the end of the text, as the CLI asks for
_PHONEMES_SHOW = 0x01  # -x: ASCII phoneme mnemonics

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)


class EspeakLibraryError(RuntimeError):
    """libespeak-ng is missing, failed to start, or has no such voice."""


class EspeakLibrary:
    """One process-wide libespeak-ng: the `-x` phoneme lines of a text for a voice."""

    _instance: EspeakLibrary | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def shared(cls) -> EspeakLibrary:
        """The library, loaded and initialised on first use."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._voice = ""
        name = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1"
        try:
            lib = ctypes.CDLL(name)
            libc = ctypes.CDLL(None)
        except OSError:
            raise EspeakLibraryError(
                "libespeak-ng not found: install it (apt-get install espeak-ng)"
            ) from None
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetPhonemeTrace.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.espeak_SetPhonemeTrace.restype = None
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
        if lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, None, 0) <= 0:
            raise EspeakLibraryError(
                "libespeak-ng failed to initialise (is espeak-ng-data installed?)"
            )
        self._callback = _CALLBACK(lambda wav, n, events: 0)  # audio is made and dropped, as -q
        lib.espeak_SetSynthCallback(self._callback)
        self._lib, self._libc = lib, libc

    def phonemes(self, line: str, voice: str) -> list[str]:
        """The non-blank lines `espeak-ng -q -x -b 1 -v voice` prints for one input line."""
        data = line.encode()
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        with self._lock:
            self._set_voice(voice)
            stream = self._libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
            if not stream:
                raise EspeakLibraryError("could not open a memory stream for espeak-ng's trace")
            try:
                self._lib.espeak_SetPhonemeTrace(_PHONEMES_SHOW, stream)
                status = self._lib.espeak_Synth(
                    data,
                    len(data) + 1,
                    0,
                    _POS_CHARACTER,
                    0,
                    _CHARS_UTF8 | _PHONEMES | _END_PAUSE,
                    None,
                    None,
                )
                self._lib.espeak_Synchronize()
            finally:
                self._lib.espeak_SetPhonemeTrace(0, None)
                self._libc.fclose(stream)  # flushes into buf
                out = ctypes.string_at(buf.value, size.value) if buf.value else b""
                self._libc.free(buf)
        if status != 0:
            raise EspeakLibraryError(f"espeak-ng failed on a line (status {status})")
        return [x.strip() for x in out.decode(errors="replace").splitlines() if x.strip()]

    def check_voice(self, voice: str) -> None:
        """Raise EspeakLibraryError unless espeak-ng has `voice`."""
        with self._lock:
            self._set_voice(voice)

    def _set_voice(self, voice: str) -> None:
        if voice != self._voice:
            if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
                self._voice = ""
                raise EspeakLibraryError(
                    f"espeak-ng voice {voice!r} does not exist (espeak-ng --voices lists them)"
                )
            self._voice = voice
