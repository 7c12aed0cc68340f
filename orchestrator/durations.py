"""Phoneme durations for phoneme-synchronous decoding: a small convolutional predictor, numpy only.

The voice's recipe trains it on the teachers' own phone timings (speech tokens per phoneme
character, FastSpeech-style); here it runs on the orchestrator, about a millisecond a sentence.
Weights: `safetensors` with `embedding [vocab, C]`, `convs.{i}.weight [C_out, C_in, K]`,
`convs.{i}.bias`, `proj.weight [1, C]`, `proj.bias [1]`; the output is log(1 + tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class DurationPredictor:
    """Speech tokens per phoneme id, from the phoneme ids of one segment."""

    def __init__(self, weights: dict[str, np.ndarray], scale: float = 1.0):
        self.scale = float(scale)  # calibration of the totals, from the predictor's JSON
        self.embedding = weights["embedding"].astype(np.float32)
        self.convs = []
        i = 0
        while f"convs.{i}.weight" in weights:
            self.convs.append(
                (
                    weights[f"convs.{i}.weight"].astype(np.float32),
                    weights[f"convs.{i}.bias"].astype(np.float32),
                )
            )
            i += 1
        self.proj_w = weights["proj.weight"].astype(np.float32)[0]
        self.proj_b = float(weights["proj.bias"][0])
        if not self.convs:
            raise ValueError("duration predictor weights hold no conv layer")

    @classmethod
    def load(cls, path: str | Path) -> DurationPredictor:
        from safetensors.numpy import load_file

        path = Path(path)
        config = read_config(path.with_suffix(".json"))
        return cls(load_file(str(path)), float(config.get("scale", 1.0)))

    def __call__(self, ids: list[int] | np.ndarray) -> np.ndarray:
        """Predicted speech tokens (float, >= 0) for each id."""
        ids = np.clip(np.asarray(ids, dtype=np.int64), 0, len(self.embedding) - 1)
        x = self.embedding[ids]  # [T, C]
        for w, b in self.convs:
            x = np.maximum(_conv1d_same(x, w) + b, 0.0)
        log_d = x @ self.proj_w + self.proj_b
        return np.maximum(np.expm1(log_d), 0.0) * self.scale


def _conv1d_same(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[T, C_in] * [C_out, C_in, K] with zero padding K // 2 each side -> [T, C_out]."""
    k = w.shape[2]
    pad = np.pad(x, ((k // 2, k - 1 - k // 2), (0, 0)))
    windows = np.lib.stride_tricks.sliding_window_view(pad, k, axis=0)  # [T, C_in, K]
    return np.tensordot(windows, w, axes=([1, 2], [1, 2]))


def schedule(
    durations: np.ndarray, band: tuple[float, float], cap: int, rate: float = 1.0
) -> tuple[list[int], list[int]]:
    """Per-phoneme [min, max] speech tokens around predicted durations, scaled by 1 / rate.

    band (1, 1) forces the schedule; a wider band lets the model's own vote decide inside it.
    Every max is at most `cap`.
    """
    d = np.asarray(durations, dtype=np.float64) / rate
    lo = np.floor(d * band[0] + 1e-6).astype(np.int64)
    hi = np.maximum(np.ceil(d * band[1] - 1e-6).astype(np.int64), lo)
    hi = np.minimum(hi, cap)
    lo = np.minimum(lo, hi)
    if band[0] == band[1]:  # a forced schedule: keep the total, round cumulatively
        ends = np.round(np.cumsum(d)).astype(np.int64)
        lo = hi = np.minimum(np.diff(ends, prepend=0), cap)
    return lo.tolist(), hi.tolist()


def read_config(path: Path) -> dict:
    """The predictor's JSON config beside its weights (training figures, vocabulary)."""
    return json.loads(path.read_text()) if path.is_file() else {}
