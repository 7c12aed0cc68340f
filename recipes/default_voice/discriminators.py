"""HiFi-GAN's two discriminators, for the adversarial stage of `distill.py` (training only).

The multi-period discriminator looks at the waveform folded by a period (2, 3, 5, 7, 11 samples)
with 2-D convs over `[time / period, period]`; the multi-scale one runs 1-D grouped convs over
the waveform at 1x, 1/2 and 1/4 rate. Each returns its scores and every layer's feature map,
which the generator's feature-matching loss compares between real and generated audio. Losses
are least squares, as in HiFi-GAN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

SLOPE = 0.1
PERIODS = (2, 3, 5, 7, 11)
Scores = list[torch.Tensor]
FeatureMaps = list[list[torch.Tensor]]


def _scored(
    convs: nn.ModuleList, post: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A conv stack with leaky ReLUs, then its score layer: (scores `[B, -1]`, feature maps)."""
    maps = []
    for conv in convs:
        x = F.leaky_relu(conv(x), SLOPE)
        maps.append(x)
    x = post(x)
    maps.append(x)
    return x.flatten(1), maps


class PeriodDiscriminator(nn.Module):
    def __init__(self, period: int):
        super().__init__()
        self.period = period
        widths = (1, 32, 128, 512, 1024)
        self.convs = nn.ModuleList(
            weight_norm(nn.Conv2d(c_in, c_out, (5, 1), (3, 1), padding=(2, 0)))
            for c_in, c_out in zip(widths, widths[1:])
        )
        self.convs.append(weight_norm(nn.Conv2d(1024, 1024, (5, 1), 1, padding=(2, 0))))
        self.post = weight_norm(nn.Conv2d(1024, 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        b, c, t = x.shape
        if t % self.period:
            x = F.pad(x, (0, self.period - t % self.period), mode="reflect")
        return _scored(self.convs, self.post, x.view(b, c, -1, self.period))


class ScaleDiscriminator(nn.Module):
    # (in, out, kernel, stride, groups)
    LAYERS = (
        (1, 128, 15, 1, 1),
        (128, 128, 41, 2, 4),
        (128, 256, 41, 2, 16),
        (256, 512, 41, 4, 16),
        (512, 1024, 41, 4, 16),
        (1024, 1024, 41, 1, 16),
        (1024, 1024, 5, 1, 1),
    )

    def __init__(self, spectral: bool = False):
        super().__init__()
        norm = spectral_norm if spectral else weight_norm
        self.convs = nn.ModuleList(
            norm(nn.Conv1d(c_in, c_out, k, s, groups=g, padding=(k - 1) // 2))
            for c_in, c_out, k, s, g in self.LAYERS
        )
        self.post = norm(nn.Conv1d(1024, 1, 3, 1, padding=1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return _scored(self.convs, self.post, x)


class Discriminators(nn.Module):
    """Every sub-discriminator of both kinds on `[B, 1, samples]` audio."""

    def __init__(self) -> None:
        super().__init__()
        self.periods = nn.ModuleList(PeriodDiscriminator(p) for p in PERIODS)
        self.scales = nn.ModuleList(ScaleDiscriminator(spectral=i == 0) for i in range(3))

    def forward(self, audio: torch.Tensor) -> tuple[Scores, FeatureMaps]:
        scores, maps = [], []
        for d in self.periods:
            s, m = d(audio)
            scores.append(s)
            maps.append(m)
        x = audio
        for i, d in enumerate(self.scales):
            if i:
                x = F.avg_pool1d(x, 4, 2, padding=2)
            s, m = d(x)
            scores.append(s)
            maps.append(m)
        return scores, maps


def discriminator_loss(real: Scores, fake: Scores) -> torch.Tensor:
    """Least squares: real audio scored 1, generated 0."""
    return torch.stack(
        [torch.mean((1 - r.float()) ** 2) + torch.mean(f.float() ** 2) for r, f in zip(real, fake)]
    ).sum()


def generator_loss(fake: Scores) -> torch.Tensor:
    """Least squares: the generator wants its audio scored 1."""
    return torch.stack([torch.mean((1 - f.float()) ** 2) for f in fake]).sum()


def feature_matching(real: FeatureMaps, fake: FeatureMaps) -> torch.Tensor:
    """L1 between the discriminators' feature maps of real and generated audio."""
    return torch.stack(
        [
            F.l1_loss(f.float(), r.detach().float())
            for real_maps, fake_maps in zip(real, fake)
            for r, f in zip(real_maps, fake_maps)
        ]
    ).sum()
