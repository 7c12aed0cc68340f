"""Pitch-preserving tempo change by WSOLA (waveform-similarity overlap-add), streamed.

Output frames of `frame` samples are laid down every `hop` samples (Hann windows at 50%
overlap sum to one). Frame k is read from the input near `k * hop * rate`, shifted by up to
`tolerance` samples to the place whose waveform best continues the previous frame, so
periods line up and the pitch stays where it was. Every decision depends only on the input
samples, never on how they were chunked: streamed output equals one-shot output exactly.
"""

import math

import numpy as np


class TimeStretch:
    """Streams mono float32 audio at `rate` times the tempo (2.0 = twice as fast), pitch kept."""

    def __init__(self, sample_rate: int, rate: float, frame_ms: float = 30.0) -> None:
        if not 0.25 <= rate <= 4.0:
            raise ValueError(f"rate must be between 0.25 and 4.0 (got {rate})")
        self.rate = float(rate)
        self.hop = max(8, round(sample_rate * frame_ms / 2000))
        self.frame = 2 * self.hop
        # +-7.5 ms at the default frame: a 15 ms search window holds a period of any voice.
        self.tolerance = self.hop // 2
        n = np.arange(self.frame)
        self.window = 0.5 - 0.5 * np.cos(2 * np.pi * n / self.frame)  # periodic Hann
        # Input is read as if `hop` zeros came first, so the first real samples are not faded
        # in; the matching first `hop` output samples are dropped.
        self._x = np.zeros(self.hop)
        self._x_start = 0  # lead-in coordinates of self._x[0]
        self._num_in = 0  # real samples pushed
        self._y = np.zeros(0)
        self._y_start = 0
        self._emitted = self.hop
        self._k = 0  # next frame
        self._prev = 0  # input position of the previous frame
        self._finished = False

    @property
    def passthrough(self) -> bool:
        """True when the rate is 1.0 and samples go through untouched."""
        return self.rate == 1.0

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Adds input; returns the output samples that are final now."""
        x = self._check(samples)
        if self.passthrough:
            return x.copy()
        self._x = np.concatenate([self._x, x.astype(np.float64)])
        self._num_in += len(x)
        return self._run(final=False)

    def finish(self) -> np.ndarray:
        """Flushes the tail; the total output is round(input length / rate) samples."""
        if self._finished:
            raise RuntimeError("TimeStretch.finish() called twice")
        self._finished = True
        if self.passthrough:
            return np.zeros(0, np.float32)
        return self._run(final=True)

    def _check(self, samples: np.ndarray) -> np.ndarray:
        if self._finished:
            raise RuntimeError("TimeStretch.push() after finish()")
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"samples must be 1-D mono (got shape {x.shape})")
        return x

    def _run(self, final: bool) -> np.ndarray:
        hop, frame, tol = self.hop, self.frame, self.tolerance
        # Never emit past the final length; before the end that length is not known yet,
        # but it is at least floor(samples so far / rate).
        if final:
            out_end = hop + round(self._num_in / self.rate)
        else:
            out_end = hop + math.floor(self._num_in / self.rate)
        x_end = hop + self._num_in
        while self._k * hop < out_end:
            k = self._k
            nominal = round(k * hop * self.rate)
            lo, hi = (0, 0) if k == 0 else (max(0, nominal - tol), nominal + tol)
            if not final and max(hi, self._prev + hop) + frame > x_end:
                break
            pos = 0
            if k > 0:
                target = self._input(self._prev + hop, frame)
                pos = lo + _best_match(self._input(lo, hi - lo + frame), target)
            self._overlap_add(k * hop, self.window * self._input(pos, frame))
            self._prev, self._k = pos, k + 1
            keep_from = min(max(0, round((k + 1) * hop * self.rate) - tol), pos + hop)
            self._x = self._x[keep_from - self._x_start :]
            self._x_start = keep_from
        # Later frames add at or after k * hop: everything before it is final.
        upto = min(self._k * hop, out_end)
        if upto <= self._emitted:
            return np.zeros(0, np.float32)
        out = self._y[self._emitted - self._y_start : upto - self._y_start].astype(np.float32)
        self._y = self._y[upto - self._y_start :]
        self._y_start = self._emitted = upto
        return out

    def _input(self, start: int, n: int) -> np.ndarray:
        """Input samples [start, start + n) in lead-in coordinates, zeros past the end."""
        seg = self._x[start - self._x_start : start - self._x_start + n]
        if len(seg) < n:
            seg = np.concatenate([seg, np.zeros(n - len(seg))])
        return seg

    def _overlap_add(self, at: int, values: np.ndarray) -> None:
        end = at + len(values) - self._y_start
        if end > len(self._y):
            self._y = np.concatenate([self._y, np.zeros(end - len(self._y))])
        self._y[at - self._y_start : end] += values


def _best_match(region: np.ndarray, target: np.ndarray) -> int:
    """Offset in `region` whose len(target) samples correlate best with target."""
    # Plain (not energy-normalised) correlation: it favours the louder of equally shaped
    # candidates, so a slowed-down sound does not stutter into silence at a sharp offset.
    return int(np.argmax(np.correlate(region, target, mode="valid")))


def time_stretch(samples: np.ndarray, sample_rate: int, rate: float) -> np.ndarray:
    """One-shot tempo change of a whole signal (same result as streaming it)."""
    stretch = TimeStretch(sample_rate, rate)
    return np.concatenate([stretch.push(samples), stretch.finish()])
