"""Log-mel front end matching the HiFi-GAN weights: torch.stft plus a Slaney mel filterbank."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from vocoder_service.hifigan import HifiGanConfig

_F_SP = 200.0 / 3  # Hz per mel below the break
_BREAK_HZ = 1000.0
_LOGSTEP = math.log(6.4) / 27.0


def hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / _F_SP
    log = _BREAK_HZ / _F_SP + np.log(np.maximum(hz, 1e-10) / _BREAK_HZ) / _LOGSTEP
    return np.where(hz >= _BREAK_HZ, log, linear)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """Inverse of `hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    brk = _BREAK_HZ / _F_SP
    return np.where(mel >= brk, _BREAK_HZ * np.exp(_LOGSTEP * (mel - brk)), _F_SP * mel)


def mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """Slaney-normalised triangular filters `[n_mels, n_fft // 2 + 1]` on the Slaney scale."""
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (fft_hz - lower) / (centre - lower)
    falling = (upper - fft_hz) / (upper - centre)
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= 2.0 / (upper - lower)  # equal area per filter
    return weights.astype(np.float32)


class MelSpectrogram:
    """Audio `[B, samples]` (or `[samples]`) in [-1, 1] -> log-mel `[B, num_mels, samples // hop]`."""

    def __init__(self, config: HifiGanConfig, device: str | torch.device = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self.basis = torch.from_numpy(
            mel_filterbank(
                config.sampling_rate, config.n_fft, config.num_mels, config.fmin, config.fmax
            )
        ).to(self.device)
        self.window = torch.hann_window(config.win_size, device=self.device)

    def __call__(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        c = self.config
        x = torch.as_tensor(audio, dtype=torch.float32, device=self.device)
        if x.ndim == 1:
            x = x[None]
        if x.ndim != 2:
            raise ValueError(
                f"audio must be [samples] or [batch, samples] (got shape {tuple(x.shape)})"
            )
        pad = (c.n_fft - c.hop_size) // 2
        if x.shape[-1] <= pad:
            raise ValueError(f"audio of {x.shape[-1]} samples is too short: need more than {pad}")
        # reflect padding instead of stft's centring keeps frames = samples // hop
        x = F.pad(x[:, None], (pad, pad), mode="reflect")[:, 0]
        spec = torch.stft(
            x,
            c.n_fft,
            hop_length=c.hop_size,
            win_length=c.win_size,
            window=self.window,
            center=False,
            return_complex=True,
        )
        mag = torch.sqrt(spec.real.square() + spec.imag.square() + 1e-9)
        return torch.log(torch.clamp(self.basis @ mag, min=1e-5))
