"""The web demo in a real browser: Debian's chromium, headless, driven by playwright.

The page talks to the orchestrator's HTTP port, which relays the public gRPC API of a real
three-process deployment (tiny random voice). Screenshots go to a temporary folder; set
SPLITTTS_WEB_SCREENSHOT=path.png to also keep the one taken after speaking a sentence.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from orchestrator.launcher import LocalDeployment
from splittts.text.v1 import text_pb2, text_pb2_grpc
from splittts.vocoder.v1 import vocoder_pb2, vocoder_pb2_grpc
from tests.ffmpeg import ffmpeg_pcm
from tests.procs import metric_value
from tests.voices import make_tts_voice

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]
LONG_TEXT = " ".join(
    f"this is sentence number {i} and it keeps the pipeline busy." for i in range(12)
)
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    # decoded phoneme by phoneme (its characters), as the default voice is: the page gets word timings
    voice_dir = make_tts_voice(
        tmp_path_factory.mktemp("voices"),
        phoneme_sync={"max_tokens_per_phoneme": 3, "min_tokens_per_phoneme": 1},
    )
    local = LocalDeployment(
        voice_dir, threads={"text": 1, "vocoder": 1}, metrics_ports=(0, -1, -1), http_port=0
    )
    local.start()
    yield local
    local.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1200, "height": 640},
        )
        yield context
        context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


class Tab:
    """One page of the demo, with JS errors collected."""

    def __init__(self, context, url: str):
        self.page = context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.goto(url)
        self.page.wait_for_function(
            "document.querySelectorAll('#voice option').length > 0", timeout=WAIT_MS
        )
        self.page.wait_for_selector("#conn.up", timeout=WAIT_MS)

    def state(self, key: str):
        return self.page.evaluate(f"window.splitTTS.{key}")

    def speak(self, text: str, chatbot: bool = False) -> None:
        self.page.fill("#text", text)
        self.page.set_checked("#chatbot", chatbot)
        self.page.click("#speak")

    def wait(self, condition: str) -> None:
        self.page.wait_for_function(condition, timeout=WAIT_MS)

    def close(self) -> None:
        self.page.close()
        assert not self.errors, self.errors


@pytest.fixture
def tab(browser, deployment):
    t = Tab(browser, deployment.http_url)
    yield t
    t.close()


def metrics(deployment) -> str:
    port = deployment.by_name("orchestrator").metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def requests_total(deployment, rpc: str, status: str) -> float:
    return (
        metric_value(
            metrics(deployment), "splittts_tts_requests_total", f'rpc="{rpc}",status="{status}"'
        )
        or 0.0
    )


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def in_flight(deployment) -> float | None:
    return metric_value(metrics(deployment), "splittts_tts_requests_in_flight")


def backends_busy(deployment) -> tuple[int, int, int]:
    with grpc.insecure_channel(deployment.by_name("text-service").address) as ch:
        mi = text_pb2_grpc.TextGenerationStub(ch).GetModelInfo(
            text_pb2.GetModelInfoRequest(), timeout=5
        )
    with grpc.insecure_channel(deployment.by_name("vocoder-service").address) as ch:
        vi = vocoder_pb2_grpc.VocoderStub(ch).GetInfo(vocoder_pb2.GetInfoRequest(), timeout=5)
    return (
        mi.num_running + mi.num_waiting + mi.num_used_blocks,
        mi.num_used_state_slots,
        vi.active_streams,
    )


def test_speak_a_sentence_schedules_audio_and_fills_the_latency_panel(tab, shots):
    text = "hello there. this is the streaming web demo."
    tab.speak(text)
    tab.wait("window.splitTTS.report !== null")
    s = tab.page.evaluate("""() => { const d = window.splitTTS; return {
        received: d.samplesReceived, scheduled: d.samplesScheduled, chunks: d.chunksReceived,
        rate: d.sampleRate, report: d.report, phase: d.phase, id: d.requestId,
        ctxRate: d.ctx.sampleRate, t: d.ctx.currentTime}; }""")
    r = s["report"]
    assert s["phase"] == "done" and r["request_id"] == s["id"]
    assert s["scheduled"] > 0 and s["scheduled"] == s["received"]
    assert s["chunks"] == r["num_chunks"] and s["rate"] == 22050
    assert s["received"] / s["rate"] == pytest.approx(r["audio_s"], rel=1e-3)
    # The AudioContext clock runs: the scheduled audio is actually being played out.
    tab.wait(f"window.splitTTS.ctx.currentTime > {s['t']} + 0.1")

    # Latency panel: headline numbers and one bar per stage and hop, all from the report.
    assert float(tab.page.text_content("#m-ttfa")) == pytest.approx(r["ttfa_ms"], abs=0.5)
    assert float(tab.page.text_content("#m-ttft")) == pytest.approx(r["ttft_ms"], abs=0.5)
    assert float(tab.page.text_content("#m-rtf")) == pytest.approx(r["rtf"], abs=5e-4)
    assert r["ttfa_ms"] > 0 and r["rtf"] > 0
    stages = tab.page.eval_on_selector_all(
        ".stage", "rows => rows.map(r => [r.children[0].textContent, r.children[2].textContent])"
    )
    names = [name for name, _ in stages]
    assert names[:5] == [
        "front end",
        "text queue",
        "text prefill",
        "text decode",
        "vocoder compute",
    ]
    assert any("text" in n and "hop" in n for n in names) and any(
        "vocoder" in n and "hop" in n for n in names
    )
    assert names[-1] == "total"
    assert all(ms.endswith(" ms") and float(ms.split()[0]) >= 0 for _, ms in stages)
    assert float(stages[-1][1].split()[0]) == pytest.approx(r["total_ms"], abs=0.1)
    details = tab.page.eval_on_selector_all(
        "#details dt, #details dd", "els => els.map(e => e.textContent)"
    )
    first = re.fullmatch(
        r"input sent ([\d.]+) ms, vocoder ([\d.]+) ms", details[details.index("first chunk") + 1]
    )
    assert first is not None and r["first_chunk_input_ms"] > 0
    assert float(first[1]) == pytest.approx(r["first_chunk_input_ms"], abs=0.051)
    assert float(first[2]) == pytest.approx(r["first_chunk_vocoder_ms"], abs=0.051)

    # Download WAV: a valid 16-bit mono file holding exactly the received samples.
    wav = tab.page.evaluate("""async () => {
        const a = document.getElementById('download');
        const b = new Uint8Array(await (await fetch(a.href)).arrayBuffer());
        return {head: String.fromCharCode(...b.slice(0, 4), ...b.slice(8, 12)), size: b.length,
                name: a.download}; }""")
    assert wav["head"] == "RIFFWAVE" and wav["size"] == 44 + 2 * s["received"]
    assert wav["name"].endswith(".wav")

    shot = shots / "spoken.png"
    tab.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("SPLITTTS_WEB_SCREENSHOT"):
        shutil.copy(shot, os.environ["SPLITTTS_WEB_SCREENSHOT"])


def test_words_are_highlighted_while_they_play(tab):
    words = ["hello", "there", "these", "words", "light", "up", "in", "turn"]
    tab.speak("hello there. these words light up in turn.")
    tab.wait("window.splitTTS.report !== null")
    got = tab.page.evaluate("window.splitTTS.words.map(w => [w.word, w.start_ms, w.end_ms])")
    assert [w for w, _, _ in got] == words
    assert tab.page.eval_on_selector_all("#words span", "s => s.map(x => x.textContent)") == words
    # as the audio plays the highlight walks the words in order, and ends after the last one
    tab.wait(
        "window.splitTTS.highlighted.length >= 6 && window.splitTTS.currentWord === null"
        " && document.querySelectorAll('#words span.said').length === 8"
    )
    seen = tab.state("highlighted")
    assert seen == [w for w in words if w in seen] and seen[-1] == "turn"
    assert tab.page.eval_on_selector_all("#words span.current", "s => s.length") == 0


def test_stop_cancels_the_whole_pipeline(tab, deployment, shots):
    cancelled = requests_total(deployment, "Synthesize", "CANCELLED")
    tab.speak(LONG_TEXT)
    tab.wait("window.splitTTS.chunksReceived >= 1")
    assert in_flight(deployment) == 1.0
    tab.page.click("#stop")
    assert wait_until(lambda: in_flight(deployment) == 0.0), "the orchestrator still has the call"
    assert wait_until(
        lambda: requests_total(deployment, "Synthesize", "CANCELLED") == cancelled + 1
    )
    assert wait_until(lambda: backends_busy(deployment) == (0, 0, 0)), backends_busy(deployment)
    assert tab.state("phase") == "stopped" and tab.state("report") is None
    assert tab.page.is_disabled("#stop")
    tab.page.screenshot(path=str(shots / "stopped.png"))


def download_bytes(tab, fmt: str) -> tuple[bytes, str]:
    """Picks `fmt` in the download menu and returns the file the link then holds, and its name."""
    import base64

    tab.page.select_option("#download-format", fmt)
    tab.wait(f"window.splitTTS.download === '{fmt}'")
    got = tab.page.evaluate("""async () => {
        const a = document.getElementById('download');
        const b = new Uint8Array(await (await fetch(a.href)).arrayBuffer());
        let s = ''; for (const x of b) s += String.fromCharCode(x);
        return {data: btoa(s), name: a.download}; }""")
    return base64.b64decode(got["data"]), got["name"]


def test_download_in_every_format_holds_the_audio_heard(tab):
    tab.speak("a sentence to download in several formats.")
    tab.wait("window.splitTTS.report !== null && window.splitTTS.download === 'wav'")
    received = tab.state("samplesReceived")
    wav, name = download_bytes(tab, "wav")
    assert name.endswith(".wav") and len(wav) == 44 + 2 * received
    flac, name = download_bytes(tab, "flac")
    assert name.endswith(".flac") and flac[:4] == b"fLaC"
    assert ffmpeg_pcm(flac, 22050) == wav[44:]  # lossless: the very samples played
    for fmt, ext, magic in (
        ("mp3", ".mp3", None),
        ("opus", ".ogg", b"OggS"),
        ("aac", ".aac", None),
    ):
        blob, name = download_bytes(tab, fmt)
        assert name.endswith(ext) and (magic is None or blob[:4] == magic)
        decoded = len(ffmpeg_pcm(blob, 22050)) // 2
        assert received - 50 <= decoded < received + 4096  # codec delay and padding at most


@pytest.mark.parametrize(
    "query, body, status, message",
    [
        ("format=aiff", b"RIFF", 400, "format must be one of mp3, flac, opus, aac"),
        ("format=mp3", b"not a wav", 400, "not a WAV file"),
        ("format=mp3", b"RIFF" + b"\0" * 40, 400, "not a WAV file"),
    ],
)
def test_encode_refuses_what_it_cannot_encode(deployment, query, body, status, message):
    import json
    import urllib.error

    req = urllib.request.Request(f"{deployment.http_url}api/encode?{query}", data=body)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == status and message in json.loads(info.value.read())["error"]


@pytest.mark.parametrize(
    "case,prepare,text,message",
    [
        ("empty text", "", "", "There is nothing to speak"),
        (
            "empty text, chatbot mode",
            "document.getElementById('chatbot').checked = true",
            "",
            "There is nothing to speak",
        ),
        (
            "unknown voice",
            "const v = document.getElementById('voice'); v.add(new Option('nobody', 'nobody'));"
            "v.value = 'nobody';",
            "hello",
            "That voice is not available",
        ),
        ("text too long", "", "a" * 5001, "That text is too long"),
    ],
)
def test_api_errors_are_shown_in_plain_words(tab, shots, case, prepare, text, message):
    tab.page.fill("#text", text)
    if prepare:
        tab.page.evaluate(f"() => {{ {prepare} }}")
    tab.page.click("#speak")
    tab.page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
    assert message in tab.page.text_content("#error")
    assert tab.state("phase") == "error" and tab.state("samplesScheduled") == 0
    if case == "empty text":
        assert tab.state("error.code") == "INVALID_ARGUMENT"
        tab.page.screenshot(path=str(shots / "error.png"))


def test_chatbot_mode_streams_pieces_through_streaming_synthesize(tab, deployment):
    before = requests_total(deployment, "StreamingSynthesize", "OK")
    text = "first we say hello. then a second sentence, in pieces."
    tab.speak(text, chatbot=True)
    tab.wait("window.splitTTS.report !== null")
    assert tab.state("typed") == text == tab.page.text_content("#typed")
    report = tab.state("report")
    assert report["num_segments"] >= 2 and report["audio_s"] > 0
    assert tab.state("samplesScheduled") == tab.state("samplesReceived") > 0
    assert requests_total(deployment, "StreamingSynthesize", "OK") == before + 1


def test_mandarin_sample_is_spoken_with_its_language(tab):
    tab.page.click("[data-sample=zh]")
    assert tab.page.input_value("#language") == "cmn-CN"
    assert "语音" in tab.page.input_value("#text")
    tab.page.click("#speak")
    tab.wait("window.splitTTS.report !== null")
    assert tab.state("report.audio_s") > 0 and tab.state("samplesScheduled") > 0


def test_two_tabs_each_get_their_own_stream(browser, deployment):
    a, b = Tab(browser, deployment.http_url), Tab(browser, deployment.http_url)
    try:
        a.speak(LONG_TEXT)
        a.wait("window.splitTTS.chunksReceived >= 1")
        b.speak("a short one for the second tab.")
        assert wait_until(lambda: in_flight(deployment) == 2.0), "both tabs should be in flight"
        a.page.click("#stop")  # stopping one tab leaves the other's stream alone
        b.wait("window.splitTTS.report !== null")
        assert wait_until(lambda: in_flight(deployment) == 0.0)
        assert a.state("report") is None and a.state("phase") == "stopped"
        assert a.state("samplesScheduled") > 0
        assert a.state("requestId") != b.state("requestId") == b.state("report.request_id")
        assert b.state("phase") == "done"
        assert b.state("samplesScheduled") == b.state("samplesReceived") > 0
        assert b.state("chunksReceived") == b.state("report.num_chunks")
    finally:
        a.close()
        b.close()


def test_service_down_is_shown_in_plain_words(browser):
    """A relay whose orchestrator is gone: the page says so instead of failing silently."""
    from orchestrator.web import WebDemo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    demo = WebDemo(dead)
    port = asyncio.run_coroutine_threadsafe(demo.start("127.0.0.1", 0), loop).result(30)
    page = browser.new_page()
    try:
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
        assert "down or unreachable" in page.text_content("#error")
        page.wait_for_selector("#conn.up", timeout=WAIT_MS)
        page.click("#speak")
        page.wait_for_function("window.splitTTS.phase === 'error'", timeout=WAIT_MS)
        assert "down or unreachable" in page.text_content("#error")
        assert page.evaluate("window.splitTTS.error.code") == "UNAVAILABLE"
    finally:
        page.close()
        asyncio.run_coroutine_threadsafe(demo.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def test_busy_http_port_is_a_one_line_start_up_error(deployment):
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "--port",
                "0",
                "--metrics-port",
                "-1",
                "--http-port",
                str(busy),
                "--voice",
                str(deployment.voice_dir),
                "--text-service",
                deployment.by_name("text-service").address,
                "--vocoder-service",
                deployment.by_name("vocoder-service").address,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 2
    assert f"--http-port {busy}:" in run.stderr and "address already in use" in run.stderr
    assert "Traceback" not in run.stderr and '"serving"' not in run.stdout


@pytest.mark.parametrize("query, jitter_ms", [("", 100), ("?jitter=150", 150), ("?jitter=x", 100)])
def test_playback_waits_for_the_jitter_buffer_the_panel_shows(
    browser, deployment, query, jitter_ms
):
    """Playback starts a jitter buffer after the first audio (100 ms, or `?jitter=MS`), and
    the latency panel says how large it is."""
    t = Tab(browser, deployment.http_url + query)
    try:
        assert t.state("jitterMs") == jitter_ms
        assert t.page.text_content("#m-jitter") == str(jitter_ms)
        t.speak("hello there")
        t.wait("window.splitTTS.report !== null")
        assert t.state("firstLeadMs") == pytest.approx(jitter_ms, abs=1.0)
        details = t.page.eval_on_selector_all(
            "#details dt, #details dd", "els => els.map(e => e.textContent)"
        )
        assert details[details.index("jitter buffer") + 1] == f"{jitter_ms} ms"
    finally:
        t.close()
