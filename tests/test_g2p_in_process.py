"""The in-process espeak-ng G2P against the `espeak-ng -q -x` CLI the voices were made with."""

import asyncio
import collections
import email
import inspect
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from orchestrator.frontend import normalize_en, normalize_zh
from orchestrator.frontend.espeak_lib import EspeakLibrary
from orchestrator.frontend.g2p import EspeakG2P
from tests.test_normalize_corpus import EN_CORPUS, ZH_CORPUS

pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="espeak-ng missing (make test installs it)"
)


def _cli(line: str, voice: str) -> list[str]:
    """What today's bundle was made with: one `espeak-ng -q -x -b 1 -v VOICE` line in, lines out."""
    out = subprocess.run(
        ["espeak-ng", "-q", "-x", "-b", "1", "-v", voice],
        input=(line + "\n").encode(),
        capture_output=True,
        check=True,
    ).stdout
    return [x.strip() for x in out.decode(errors="replace").splitlines() if x.strip()]


def _english_sentences() -> list[str]:
    """Varied English: the normaliser corpus and sentences from standard-library docstrings."""
    sentences = [normalize_en(text) for text, _ in EN_CORPUS]
    for module in (asyncio, collections, email, json, logging, pathlib, textwrap, threading):
        for _, obj in sorted(inspect.getmembers(module), key=lambda m: m[0]):
            doc = inspect.getdoc(obj) or ""
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                if 20 <= len(sentence) <= 200 and re.fullmatch(r"[A-Za-z ,;:.!?'()-]+", sentence):
                    sentences.append(sentence)
    return list(dict.fromkeys(sentences))[:320]


def _mandarin_sentences() -> list[str]:
    """Varied Mandarin: the normaliser corpus and phrases from pypinyin's dictionary, in clauses."""
    from pypinyin.phrases_dict import phrases_dict

    phrases = sorted(p for p in phrases_dict if 2 <= len(p) <= 4)
    phrases = phrases[:: len(phrases) // 300][:300]
    made = [
        f"{a}，{b}{c}。" if i % 2 else f"{a}{b}？{c}！"
        for i, (a, b, c) in enumerate(zip(phrases[0::3], phrases[1::3], phrases[2::3]))
    ]
    return [normalize_zh(text) for text, _ in ZH_CORPUS] + made[:100]


@pytest.mark.parametrize(
    "voice,sentences", [("en-us", _english_sentences()), ("cmn-latn-pinyin", _mandarin_sentences())]
)
def test_same_phonemes_as_the_cli(voice, sentences):
    """Byte for byte what the subprocess G2P printed, on whole sentences and line by line."""
    assert len(sentences) >= (300 if voice == "en-us" else 100)
    cli_lines: dict[str, list[str]] = {}

    def oracle(line: str, v: str) -> list[str]:
        cli_lines[line] = _cli(line, v)
        return cli_lines[line]

    in_process = EspeakG2P(voice, keep_punctuation=True)
    cli = EspeakG2P(voice, keep_punctuation=True, phonemize=oracle)
    for sentence in sentences:
        assert in_process(sentence) == cli(sentence), sentence
    library = EspeakLibrary.shared()
    for line, expected in cli_lines.items():
        assert library.phonemes(line, voice) == expected, line


def test_concurrent_calls_in_two_voices_match_serial_ones():
    """The library is not re-entrant: calls from many threads, switching voices, stay correct."""
    texts = [("en-us", f"Thread safety check number {i}, said plainly.") for i in range(12)]
    texts += [("cmn-latn-pinyin", f"ni3 hao3, di4 {i} ge4 wen4 ti2.") for i in range(12)]
    library = EspeakLibrary.shared()
    expected = {(v, t): library.phonemes(t, v) for v, t in texts}
    got, errors = {}, []

    def work(offset: int) -> None:
        try:
            for k in range(len(texts)):
                v, t = texts[(k + offset) % len(texts)]
                got[(v, t, offset)] = library.phonemes(t, v)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i * 5,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(got) == 6 * len(texts)
    assert all(got[(v, t, o)] == expected[(v, t)] for v, t, o in got)


def test_warmup_loads_pinyin_and_the_voices():
    """After FrontEnd.warmup the first Mandarin request has nothing left to import."""
    script = (
        "import json, sys\n"
        "from orchestrator.frontend import FrontEnd\n"
        "fe = FrontEnd({'cmn-CN': {'g2p': 'espeak-ng', 'espeak_voice': 'cmn-latn-pinyin',"
        " 'keep_punctuation': True}})\n"
        "loaded = lambda: [m in sys.modules for m in ('pypinyin', 'cn2an')]\n"
        "before = loaded()\n"
        "fe.warmup()\n"
        "print(json.dumps([before, loaded()]))\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    ).stdout
    assert json.loads(out) == [[False, False], [True, True]]
