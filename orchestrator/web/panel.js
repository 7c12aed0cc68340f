// split-tts web demo: the latency panel and the Download WAV link, filled when a report arrives.
"use strict";

// -- latency panel -------------------------------------------------------------------------
function fmt(x, digits = 1) { return Number(x || 0).toFixed(digits); }

function resetReport() {
  for (const id of ["m-ttfa", "m-ttft", "m-rtf", "m-underruns"]) $(id).textContent = "–";
  $("stages").replaceChildren();
  $("details").replaceChildren();
  const a = $("download");
  if (a.href) URL.revokeObjectURL(a.href);
  a.removeAttribute("href");
  a.classList.add("disabled");
  a.setAttribute("aria-disabled", "true");
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
  const details = [["audio", `${fmt(r.audio_s, 2)} s`], ["chunks", r.num_chunks],
                   ["speech tokens", r.num_speech_tokens], ["segments", r.num_segments],
                   ["max chunk gap", `${fmt(r.max_chunk_gap_ms)} ms`], ["audio s / wall s", fmt(r.rtf ? 1 / r.rtf : 0, 2)],
                   ["request id", r.request_id], ["browser underruns", demo.underruns]];
  $("details").replaceChildren(...details.flatMap(([k, v]) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = String(v);
    return [dt, dd];
  }));
}

// -- Download WAV --------------------------------------------------------------------------
function makeWav() {
  const n = pcm.reduce((s, c) => s + c.length, 0);
  if (!n) return;
  const out = new DataView(new ArrayBuffer(44 + 2 * n));
  const text = (at, s) => { for (let i = 0; i < s.length; i++) out.setUint8(at + i, s.charCodeAt(i)); };
  const rate = demo.sampleRate;
  text(0, "RIFF"); out.setUint32(4, 36 + 2 * n, true); text(8, "WAVE");
  text(12, "fmt "); out.setUint32(16, 16, true); out.setUint16(20, 1, true); out.setUint16(22, 1, true);
  out.setUint32(24, rate, true); out.setUint32(28, rate * 2, true); out.setUint16(32, 2, true); out.setUint16(34, 16, true);
  text(36, "data"); out.setUint32(40, 2 * n, true);
  let at = 44;
  for (const chunk of pcm) for (let i = 0; i < chunk.length; i++, at += 2) out.setInt16(at, chunk[i], true);
  const a = $("download");
  a.href = URL.createObjectURL(new Blob([out.buffer], { type: "audio/wav" }));
  a.download = `split-tts-${demo.requestId || "speech"}.wav`;
  a.classList.remove("disabled");
  a.removeAttribute("aria-disabled");
}
