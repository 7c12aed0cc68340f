"""Scoring helpers: pocketsphinx WER with a closed-domain LM, DNSMOS, mel-cepstral distortion."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import numpy as np


def words(text: str) -> list[str]:
    """Lower-case words without punctuation, as the recogniser spells them."""
    return re.findall(r"[a-z']+", text.lower())


def write_arpa(sentences: list[str], path: Path, discount: float = 0.5) -> None:
    """A bigram ARPA LM with absolute discounting and back-off to unigrams."""
    uni: Counter = Counter()
    bi: Counter = Counter()
    for s in sentences:
        w = ["<s>"] + words(s) + ["</s>"]
        uni.update(w)
        bi.update(zip(w, w[1:]))
    total = sum(c for w, c in uni.items() if w != "<s>")
    vocab = sorted(uni)
    followers: Counter = Counter(a for a, _ in bi)
    lines = ["\\data\\", f"ngram 1={len(vocab)}", f"ngram 2={len(bi)}", "", "\\1-grams:"]
    for w in vocab:
        p = -99.0 if w == "<s>" else math.log10(uni[w] / total)
        seen = sum(c for (a, _), c in bi.items() if a == w)
        bo = math.log10(discount * followers[w] / seen) if seen else 0.0
        lines.append(f"{p:.4f} {w} {bo:.4f}")
    lines += ["", "\\2-grams:"]
    out_counts: Counter = Counter()
    for (a, _), c in bi.items():
        out_counts[a] += c
    for (a, b), c in sorted(bi.items()):
        lines.append(f"{math.log10((c - discount) / out_counts[a]):.4f} {a} {b}")
    lines += ["", "\\end\\", ""]
    path.write_text("\n".join(lines))


class Recognizer:
    """pocketsphinx 5 with its bundled English acoustic model and a given ARPA LM."""

    def __init__(self, lm_path: Path):
        import os

        import pocketsphinx

        model = pocketsphinx.get_model_path()
        config = pocketsphinx.Config(
            hmm=os.path.join(model, "en-us", "en-us"),
            lm=str(lm_path),
            dict=os.path.join(model, "en-us", "cmudict-en-us.dict"),
            loglevel="FATAL",
        )
        self.decoder = pocketsphinx.Decoder(config)

    def __call__(self, audio16k: np.ndarray) -> str:
        pcm = (np.clip(audio16k, -1, 1) * 32767).astype(np.int16).tobytes()
        self.decoder.start_utt()
        self.decoder.process_raw(pcm, full_utt=True)
        self.decoder.end_utt()
        hyp = self.decoder.hyp()
        return hyp.hypstr if hyp is not None else ""


def word_errors(ref: str, hyp: str) -> tuple[int, int]:
    """(edit distance in words, reference length)."""
    r, h = words(ref), words(hyp)
    prev = list(range(len(h) + 1))
    for i, a in enumerate(r, 1):
        cur = [i]
        for j, b in enumerate(h, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a != b)))
        prev = cur
    return prev[-1], len(r)


def dnsmos(audio16k: np.ndarray) -> float:
    """DNSMOS overall quality (P.835 OVRL) from speechmos."""
    import os

    import onnxruntime as ort
    from speechmos import dnsmos as dm

    if dm.dnsmos is None:  # one thread each: spinning ONNX threads crawl on a shared machine
        folder = os.path.join(os.path.dirname(dm.__file__), "dnsmos_models")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        scorer = dm.DNSMOS.__new__(dm.DNSMOS)
        scorer.primary_model_path = os.path.join(folder, "sig_bak_ovr.onnx")
        scorer.onnx_sess = ort.InferenceSession(
            scorer.primary_model_path, opts, providers=["CPUExecutionProvider"]
        )
        scorer.p808_onnx_sess = ort.InferenceSession(
            os.path.join(folder, "model_v8.onnx"), opts, providers=["CPUExecutionProvider"]
        )
        dm.dnsmos = scorer
    peak = np.abs(audio16k).max()
    x = audio16k / peak * 0.9 if peak > 0 else audio16k
    return float(dm.run(x.astype(np.float32), 16000)["ovrl_mos"])


def cepstra(log_mel: np.ndarray, n: int = 13) -> np.ndarray:
    """Cepstral coefficients 1..n-1 of a natural-log mel spectrogram `[80, T]` -> `[T, n-1]`."""
    from scipy.fft import dct

    return dct(log_mel, type=2, axis=0, norm="ortho")[1:n].T


def dtw_path(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs of the minimum-cost monotonic alignment of frames `a[T1, D]` and `b[T2, D]`."""
    cost = np.sqrt(((a[:, None] - b[None]) ** 2).sum(-1))
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0
    for i in range(1, n + 1):
        row, prev = acc[i], acc[i - 1]
        c = cost[i - 1]
        diag_up = np.minimum(prev[:-1], prev[1:]) + c
        # the left move needs a running minimum along the row
        for j in range(1, m + 1):
            row[j] = min(diag_up[j - 1], row[j - 1] + c[j - 1])
    i, j, pi, pj = n, m, [], []
    while i > 0 and j > 0:
        pi.append(i - 1)
        pj.append(j - 1)
        step = np.argmin([acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]])
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    return np.array(pi[::-1]), np.array(pj[::-1])


def mcd(log_mel_a: np.ndarray, log_mel_b: np.ndarray) -> float:
    """Mel-cepstral distortion in dB after DTW (cepstra from the log-mel, c0 excluded)."""
    a, b = cepstra(log_mel_a), cepstra(log_mel_b)
    ia, ib = dtw_path(a, b)
    diff = a[ia] - b[ib]
    return float(np.mean(10.0 / math.log(10) * np.sqrt(2 * (diff**2).sum(-1))))
