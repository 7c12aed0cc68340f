// split-tts web demo: relay of the public gRPC API over a WebSocket, played with Web Audio.
"use strict";

const SAMPLES = {
  en: "Hello! This is split-tts. The audio starts while the rest of the sentence is still being generated.",
  zh: "你好，欢迎使用流式语音合成。声音会在文字生成的同时开始播放。",
};
// Jitter buffer: playback starts this long after the first audio arrives (and again after it
// ran dry), so a chunk that arrives up to this late still plays without a gap. The latency
// panel shows it; `?jitter=MS` sets it (0-1000 ms).
const JITTER_MS = jitterFromQuery(100);
const PEAK_BIN_S = 0.005;  // waveform resolution

const $ = (id) => document.getElementById(id);
// Counters the browser tests read; also handy from the console.
const demo = window.splitTTS = {
  phase: "idle", requestId: null, ctx: null, report: null, error: null,
  chunksReceived: 0, samplesReceived: 0, samplesScheduled: 0, underruns: 0,
  firstAudioMs: null, typed: "", sampleRate: 0, download: null,
  words: [], currentWord: null, highlighted: [], jitterMs: JITTER_MS, firstLeadMs: null,
};
let ws = null, voices = [], sources = [], pcm = [], peaks = [], timeline = [];
let nextTime = 0, playStart = 0, clickedAt = 0, typer = null, drawing = false, frozenAt = null;

// -- connection ---------------------------------------------------------------------------
function connect() {
  const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws";
  ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  ws.onopen = () => setConn("connected", "up");
  ws.onclose = () => {
    setConn("disconnected: retrying", "down");
    if (demo.phase === "speaking") fail("The connection to the server was lost while speaking.");
    setTimeout(connect, 1000);
  };
  ws.onmessage = (ev) => (typeof ev.data === "string" ? onMessage(JSON.parse(ev.data)) : onAudio(ev.data));
}

function setConn(text, cls) { const c = $("conn"); c.textContent = text; c.className = "conn " + cls; }

function send(obj) {
  if (!ws || ws.readyState !== WebSocket.OPEN) { fail("Not connected to the server yet; try again in a moment."); return false; }
  ws.send(JSON.stringify(obj));
  return true;
}

async function loadVoices() {
  try {
    const r = await fetch("/api/voices");
    const body = await r.json();
    if (!r.ok) throw new Error(body.error || r.statusText);
    voices = body.voices;
  } catch (e) {
    fail("Could not load the voice list: " + e.message);
    return;
  }
  $("voice").replaceChildren(...voices.map((v) => new Option(
    v.name + (v.is_default ? " (default)" : ""), v.name, v.is_default, v.is_default)));
  fillLanguages();
}

function fillLanguages() {
  const v = voices.find((x) => x.name === $("voice").value);
  const auto = new Option("auto-detect", "");
  $("language").replaceChildren(auto, ...(v ? v.language_codes : []).map((l) => new Option(l, l)));
}

// -- speaking ------------------------------------------------------------------------------
function audioContext(rate) {
  if (demo.ctx && demo.ctx.sampleRate !== rate && rate) { demo.ctx.close(); demo.ctx = null; }
  if (!demo.ctx) {
    try { demo.ctx = rate ? new AudioContext({ sampleRate: rate }) : new AudioContext(); }
    catch (e) { demo.ctx = new AudioContext(); }  // the voice's rate is not allowed here
  }
  demo.ctx.resume();
  return demo.ctx;
}

function speak() {
  stopPlayback();
  clearError();
  const voice = voices.find((x) => x.name === $("voice").value);
  audioContext(voice ? voice.sample_rate_hz : 0);  // created inside the click: autoplay allows it
  Object.assign(demo, { phase: "speaking", report: null, error: null, requestId: null, chunksReceived: 0,
                        samplesReceived: 0, samplesScheduled: 0, underruns: 0, firstAudioMs: null, typed: "",
                        firstLeadMs: null });
  pcm = []; peaks = []; timeline = []; nextTime = 0; playStart = 0; frozenAt = null;
  Object.assign(demo, { words: [], currentWord: null, highlighted: [] });
  $("words").textContent = "";
  clickedAt = performance.now();
  resetReport();
  const text = $("text").value;
  const config = { voice: $("voice").value, language_code: $("language").value,
                   speaking_rate: parseFloat($("rate").value) };
  const chatbot = $("chatbot").checked;
  if (!send(chatbot ? { type: "stream", ...config } : { type: "speak", text, ...config })) return;
  setPhase("speaking");
  $("stop").disabled = false;
  $("typed-box").hidden = !chatbot;
  $("typed").textContent = "";
  if (chatbot) typeLikeAChatbot(text);
  if (!drawing) { drawing = true; requestAnimationFrame(draw); }
}

// Feed the text in uneven pieces, as tokens come out of a chatbot.
function typeLikeAChatbot(text) {
  let at = 0;
  const step = () => {
    if (demo.phase !== "speaking") return;
    if (at >= text.length) { typer = null; send({ type: "end" }); return; }
    const n = 1 + Math.floor(Math.random() * 6);
    const piece = text.slice(at, at + n);
    at += n;
    demo.typed += piece;
    $("typed").textContent = demo.typed;
    send({ type: "text", text: piece });
    typer = setTimeout(step, 40 + Math.random() * 60);
  };
  step();
}

function stop() {
  if (typer) { clearTimeout(typer); typer = null; }
  send({ type: "stop" });
  stopPlayback();
  if (demo.phase === "speaking") setPhase("stopped");
  $("stop").disabled = true;
}

function stopPlayback() {
  if (demo.ctx && sources.length) frozenAt = demo.ctx.currentTime;  // the playhead stays put
  for (const s of sources) { try { s.stop(); } catch (e) { /* not started yet */ } }
  sources = [];
}

function onMessage(msg) {
  if (msg.type === "started") demo.requestId = msg.request_id;
  else if (msg.type === "report" && msg.report.request_id === demo.requestId) finish(msg.report);
  else if (msg.type === "words" && demo.phase === "speaking") addWords(msg.words);
  else if (msg.type === "error") fail(msg.message, msg);
}

function onAudio(buf) {
  if (demo.phase !== "speaking" || !demo.requestId) return;  // a late chunk of an earlier utterance
  const head = new DataView(buf, 0, 16);
  const rate = head.getInt32(4, true);
  const ints = new Int16Array(buf, 16);
  const samples = new Float32Array(ints.length);
  for (let i = 0; i < ints.length; i++) samples[i] = ints[i] / 32768;
  pcm.push(ints);
  addPeaks(samples, rate);
  demo.sampleRate = rate;
  demo.chunksReceived += 1;
  demo.samplesReceived += ints.length;
  if (demo.firstAudioMs === null) demo.firstAudioMs = performance.now() - clickedAt;
  schedule(samples, rate);
  updateLive();
}

// Gapless: each chunk starts exactly where the previous one ends on the AudioContext clock.
function schedule(samples, rate) {
  const ctx = demo.ctx;
  if (!samples.length) return;
  const buffer = ctx.createBuffer(1, samples.length, rate);
  buffer.getChannelData(0).set(samples);
  const src = ctx.createBufferSource();
  src.buffer = buffer;
  src.connect(ctx.destination);
  const now = ctx.currentTime;
  if (!playStart) {
    nextTime = now + JITTER_MS / 1000; playStart = nextTime;
    demo.firstLeadMs = 1000 * (nextTime - now);  // how far ahead of the clock playback starts
  }
  else if (nextTime < now) { demo.underruns += 1; nextTime = now + JITTER_MS / 1000; }  // ran dry
  src.start(nextTime);
  timeline.push({ at: nextTime, offset: demo.samplesScheduled / rate, dur: buffer.duration });
  src.onended = () => { sources = sources.filter((s) => s !== src); };
  sources.push(src);
  nextTime += buffer.duration;
  demo.samplesScheduled += samples.length;
}

function finish(report) {
  demo.report = report;
  if (demo.phase === "speaking") setPhase("done");
  $("stop").disabled = sources.length === 0;
  showReport(report);
  makeDownload();
  updateLive();
}

function fail(message, detail) {
  if (typer) { clearTimeout(typer); typer = null; }
  demo.error = detail || { message };
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
  if (demo.phase === "speaking") setPhase("error");
  $("stop").disabled = true;
}

function clearError() { $("error").hidden = true; $("error").textContent = ""; }

function setPhase(p) { demo.phase = p; const el = $("phase"); el.textContent = p; el.className = "phase " + p; }

function updateLive() {
  const rate = demo.sampleRate || 1;
  let text = `${demo.chunksReceived} chunks · ${(demo.samplesReceived / rate).toFixed(2)} s received`;
  if (demo.firstAudioMs !== null) text += ` · first audio in the browser after ${demo.firstAudioMs.toFixed(0)} ms`;
  $("live").textContent = text;
}

// -- words, highlighted while they play ----------------------------------------------------
function addWords(words) {
  const box = $("words");
  for (const w of words) {
    const span = document.createElement("span");
    span.textContent = w.word;
    box.append(span, " ");
    demo.words.push({ ...w, el: span });
  }
}

function highlightWords(playedMs) {
  let current = null;
  for (const w of demo.words) {
    const said = w.start_ms <= playedMs;
    w.el.classList.toggle("said", said && playedMs >= w.end_ms);
    const now = said && playedMs < w.end_ms;
    w.el.classList.toggle("current", now);
    if (now) current = w;
  }
  if (current && current !== demo.current) demo.highlighted.push(current.word);  // for the tests
  demo.current = current;
  demo.currentWord = current ? current.word : null;
}

// -- waveform ------------------------------------------------------------------------------
function addPeaks(samples, rate) {
  const bin = Math.max(1, Math.round(rate * PEAK_BIN_S));
  for (let i = 0; i < samples.length; i += bin) {
    let lo = 0, hi = 0;
    for (let j = i; j < Math.min(i + bin, samples.length); j++) { lo = Math.min(lo, samples[j]); hi = Math.max(hi, samples[j]); }
    peaks.push([lo, hi]);
  }
}

// Seconds of the utterance played so far (gaps after an underrun do not count).
function playedSeconds() {
  if (!demo.ctx || !timeline.length) return 0;
  const now = frozenAt === null ? demo.ctx.currentTime : frozenAt;
  let played = 0;
  for (const t of timeline) {
    if (t.at > now) break;
    played = t.offset + Math.min(now - t.at, t.dur);
  }
  return played;
}

function draw() {
  const canvas = $("wave");
  const dpr = window.devicePixelRatio || 1;
  const w = Math.round(canvas.clientWidth * dpr), h = Math.round(canvas.clientHeight * dpr);
  if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, w, h);
  const seconds = peaks.length * PEAK_BIN_S;
  const span = Math.max(4, seconds * 1.1);
  const played = playedSeconds();
  highlightWords(1000 * played);
  const mid = h / 2;
  g.fillStyle = "#e2e5eb";
  g.fillRect(0, mid, w, 1);
  for (let x = 0; x < w; x++) {
    const a = Math.floor((x / w) * span / PEAK_BIN_S), b = Math.floor(((x + 1) / w) * span / PEAK_BIN_S);
    if (a >= peaks.length) break;
    let lo = 0, hi = 0;
    for (let i = a; i < Math.max(a + 1, Math.min(b, peaks.length)); i++) { lo = Math.min(lo, peaks[i][0]); hi = Math.max(hi, peaks[i][1]); }
    g.fillStyle = (x / w) * span <= played ? "#2f6fec" : "#b9cdf8";
    g.fillRect(x, mid - hi * mid * 0.95, 1, Math.max(1, (hi - lo) * mid * 0.95));
  }
  if (played > 0 && played < span) {
    g.fillStyle = "#1d2330";
    g.fillRect(Math.round((played / span) * w), 0, Math.max(1, dpr), h);
  }
  const busy = demo.phase === "speaking" || sources.length > 0;
  if (!busy) $("stop").disabled = true;
  if (busy) requestAnimationFrame(draw); else drawing = false;
}

// -- wiring --------------------------------------------------------------------------------
$("speak").onclick = speak;
$("stop").onclick = stop;
$("voice").onchange = fillLanguages;
$("download-format").onchange = () => { if (demo.report) makeDownload(); };
$("rate").oninput = () => { $("rate-value").textContent = `${parseFloat($("rate").value).toFixed(2)}×`; };
$("text").onkeydown = (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); speak(); } };
for (const b of document.querySelectorAll("[data-sample]")) {
  b.onclick = () => {
    $("text").value = SAMPLES[b.dataset.sample];
    const lang = b.dataset.sample === "zh" ? "cmn" : "en";
    const opt = [...$("language").options].find((o) => o.value.startsWith(lang));
    $("language").value = opt ? opt.value : "";
  };
}
$("text").value = SAMPLES.en;
$("m-jitter").textContent = String(JITTER_MS);
connect();
loadVoices();
draw();

function jitterFromQuery(fallbackMs) {
  const raw = new URLSearchParams(location.search).get("jitter");
  const ms = Number(raw);
  return raw !== null && raw !== "" && Number.isFinite(ms) && ms >= 0 && ms <= 1000 ? ms : fallbackMs;
}
