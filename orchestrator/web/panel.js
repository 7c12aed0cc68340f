// split-tts web demo: the latency panel and the Download link, filled when a report arrives.
"use strict";

// -- latency panel -------------------------------------------------------------------------
function fmt(x, digits = 1) { return Number(x || 0).toFixed(digits); }

function resetReport() {
  for (const id of ["m-ttfa", "m-ttft", "m-rtf", "m-underruns"]) $(id).textContent = "–";
  $("stages").replaceChildren();
  $("details").replaceChildren();
  clearDownload();
}

function showReport(r) {
  $("m-ttfa").textContent = fmt(r.ttfa_ms, 0);
  $("m-ttft").textContent = fmt(r.ttft_ms, 0);
  $("m-rtf").textContent = fmt(r.rtf, 3);
  $("m-underruns").textContent = `${r.underruns} · ${demo.underruns}`;
  const rows = [["front end", r.frontend_ms], ["text queue", r.queue_ms], ["text prefill", r.prefill_ms],
                ["text decode", r.decode_ms], ["vocoder compute", r.vocoder_compute_ms]];
  const hops = (r.hops || []).map((h) => [`hop → ${h.service} (transit)`, h.mean_overhead_ms, "hop",
                                          `mean per message; max ${fmt(h.max_overhead_ms, 2)} ms; ${h.address}`]);
  const all = [...rows, ...hops, ["total", r.total_ms, "total"]];
  const scale = Math.max(1e-9, ...all.map((x) => x[1] || 0));
  $("stages").replaceChildren(...all.map(([name, ms, cls, title]) => {
    const row = document.createElement("div");
    row.className = "stage " + (cls || "");
    if (title) row.title = title;
    const label = document.createElement("span"); label.textContent = name;
    const bar = document.createElement("div"); bar.className = "bar";
    const fill = document.createElement("span"); fill.style.width = `${(100 * (ms || 0)) / scale}%`;
    bar.append(fill);
    const value = document.createElement("span"); value.className = "ms";
    value.textContent = `${fmt(ms, ms < 10 ? 2 : 1)} ms`;
    row.append(label, bar, value);
    return row;
  }));
  const details = [["first chunk", `input sent ${fmt(r.first_chunk_input_ms)} ms, vocoder ${fmt(r.first_chunk_vocoder_ms)} ms`],
                   ["audio", `${fmt(r.audio_s, 2)} s`], ["chunks", r.num_chunks],
                   ["speech tokens", r.num_speech_tokens], ["segments", r.num_segments],
                   ["max chunk gap", `${fmt(r.max_chunk_gap_ms)} ms`], ["audio s / wall s", fmt(r.rtf ? 1 / r.rtf : 0, 2)],
                   ["request id", r.request_id], ["browser underruns", demo.underruns],
                   ["jitter buffer", `${demo.jitterMs} ms`]];
  $("details").replaceChildren(...details.flatMap(([k, v]) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = String(v);
    return [dt, dd];
  }));
}

// -- Download ------------------------------------------------------------------------------
// WAV is built here from the samples received; the other formats are that WAV encoded by the
// server (/api/encode), so every download holds the audio that was heard.
const DOWNLOAD_EXT = { wav: "wav", mp3: "mp3", flac: "flac", opus: "ogg", aac: "aac" };
let downloadSeq = 0;

function clearDownload() {
  downloadSeq++;  // a request still encoding for the previous state is dropped
  const a = $("download");
  if (a.href) URL.revokeObjectURL(a.href);
  a.removeAttribute("href");
  a.classList.add("disabled");
  a.setAttribute("aria-disabled", "true");
  demo.download = null;
}

function wavBlob() {
  const n = pcm.reduce((s, c) => s + c.length, 0);
  if (!n) return null;
  const out = new DataView(new ArrayBuffer(44 + 2 * n));
  const text = (at, s) => { for (let i = 0; i < s.length; i++) out.setUint8(at + i, s.charCodeAt(i)); };
  const rate = demo.sampleRate;
  text(0, "RIFF"); out.setUint32(4, 36 + 2 * n, true); text(8, "WAVE");
  text(12, "fmt "); out.setUint32(16, 16, true); out.setUint16(20, 1, true); out.setUint16(22, 1, true);
  out.setUint32(24, rate, true); out.setUint32(28, rate * 2, true); out.setUint16(32, 2, true); out.setUint16(34, 16, true);
  text(36, "data"); out.setUint32(40, 2 * n, true);
  let at = 44;
  for (const chunk of pcm) for (let i = 0; i < chunk.length; i++, at += 2) out.setInt16(at, chunk[i], true);
  return new Blob([out.buffer], { type: "audio/wav" });
}

async function makeDownload() {
  clearDownload();
  const seq = downloadSeq, format = $("download-format").value;
  let blob = wavBlob();
  if (!blob) return;
  if (format !== "wav") {
    demo.download = "encoding";
    try {
      const r = await fetch(`/api/encode?format=${format}`, { method: "POST", body: blob });
      if (!r.ok) throw new Error((await r.json()).error || r.statusText);
      blob = new Blob([await r.arrayBuffer()], { type: r.headers.get("Content-Type") });
    } catch (e) {
      if (seq === downloadSeq) demo.download = "failed";
      console.warn("encoding the download failed:", e);
      return;
    }
    if (seq !== downloadSeq) return;
  }
  const a = $("download");
  a.href = URL.createObjectURL(blob);
  a.download = `split-tts-${demo.requestId || "speech"}.${DOWNLOAD_EXT[format]}`;
  a.classList.remove("disabled");
  a.removeAttribute("aria-disabled");
  demo.download = format;
}
