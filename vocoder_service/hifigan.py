"""HiFi-GAN generator: V1, V2 and V3 are this code with different JSON configs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from kernels import onednn_conv

LRELU_SLOPE = 0.1
EDGE_KERNEL = 7  # conv_pre and conv_post
_REQUIRED = (
    "resblock",
    "upsample_rates",
    "upsample_kernel_sizes",
    "upsample_initial_channel",
    "resblock_kernel_sizes",
    "resblock_dilation_sizes",
)


@dataclass(frozen=True)
class HifiGanConfig:
    """Generator architecture and the mel recipe it was trained on (jik876 config.json keys)."""

    resblock: str
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    upsample_initial_channel: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    # how many residual blocks each upsampling stage has: the first n of the kernels above
    # (None: every kernel in every stage, as in the jik876 configs)
    resblocks_per_stage: tuple[int, ...] | None = None
    num_mels: int = 80
    sampling_rate: int = 22050
    n_fft: int = 1024
    hop_size: int = 256
    win_size: int = 1024
    fmin: float = 0.0
    fmax: float | None = 8000.0

    def __post_init__(self) -> None:
        if self.resblock not in ("1", "2"):
            raise ValueError(f"resblock must be '1' or '2' (got {self.resblock!r})")
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes) or not self.upsample_rates:
            raise ValueError(
                "upsample_rates and upsample_kernel_sizes must be non-empty and of equal length"
            )
        for u, k in zip(self.upsample_rates, self.upsample_kernel_sizes):
            if u < 1 or k < u or (k - u) % 2:
                raise ValueError(
                    f"upsample kernel {k} with rate {u}: need kernel >= rate and an even "
                    "difference, else the output is not frames * hop_size samples long"
                )
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError(
                "resblock_kernel_sizes and resblock_dilation_sizes must have equal length"
            )
        if any(k % 2 == 0 for k in self.resblock_kernel_sizes):
            raise ValueError(
                f"resblock kernel sizes must be odd (got {list(self.resblock_kernel_sizes)})"
            )
        if self.resblocks_per_stage is not None and (
            len(self.resblocks_per_stage) != len(self.upsample_rates)
            or not all(1 <= n <= len(self.resblock_kernel_sizes) for n in self.resblocks_per_stage)
        ):
            raise ValueError(
                "resblocks_per_stage needs one count per upsampling stage, each from 1 to "
                f"{len(self.resblock_kernel_sizes)} (got {list(self.resblocks_per_stage)})"
            )
        if self.resblock == "2" and any(len(d) != 2 for d in self.resblock_dilation_sizes):
            raise ValueError("resblock '2' needs exactly two dilations per kernel")
        if self.upsample_initial_channel % (2 ** len(self.upsample_rates)):
            raise ValueError("upsample_initial_channel must halve cleanly at every upsample stage")
        if math.prod(self.upsample_rates) != self.hop_size:
            raise ValueError(
                f"prod(upsample_rates) = {math.prod(self.upsample_rates)} but hop_size = {self.hop_size}: "
                "the generator would not produce hop_size samples per mel frame; fix config.json"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HifiGanConfig:
        """Build from a parsed config.json; training-only keys are ignored."""
        known = {f.name for f in fields(cls)}
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"HiFi-GAN config lacks {', '.join(missing)}")
        kw = {k: v for k, v in data.items() if k in known}
        kw["resblock"] = str(kw["resblock"])
        for key in ("upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes"):
            kw[key] = tuple(int(v) for v in kw[key])
        if kw.get("resblocks_per_stage") is not None:
            kw["resblocks_per_stage"] = tuple(int(v) for v in kw["resblocks_per_stage"])
        kw["resblock_dilation_sizes"] = tuple(
            tuple(int(v) for v in d) for d in kw["resblock_dilation_sizes"]
        )
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> HifiGanConfig:
        """Read a jik876-style config.json."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (used to key exported models); a key at its default is left out, so
        a config that does not use it reads (and keys) as before it existed."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "resblocks_per_stage" or self.resblocks_per_stage is not None
        }

    def stage_blocks(self) -> list[list[tuple[int, tuple[int, ...]]]]:
        """Each upsampling stage's residual blocks as (kernel, dilations), in order."""
        blocks = list(zip(self.resblock_kernel_sizes, self.resblock_dilation_sizes))
        counts = self.resblocks_per_stage or (len(blocks),) * len(self.upsample_rates)
        return [blocks[:n] for n in counts]

    @property
    def receptive_field(self) -> tuple[int, int]:
        """(left, right) mel frames an output frame depends on; see `receptive_field_frames`."""
        return receptive_field_frames(self)


def resblock_reach(config: HifiGanConfig, kernel: int, dilations: tuple[int, ...]) -> int:
    """Samples one residual block reads on each side of an output sample, at its stage's rate."""
    reach = sum((kernel - 1) * d // 2 for d in dilations)
    if config.resblock == "1":
        reach += len(dilations) * ((kernel - 1) // 2)  # each unit's second, undilated conv
    return reach


def receptive_field_frames(config: HifiGanConfig) -> tuple[int, int]:
    """Exact (left, right) context in mel frames that the samples of one frame depend on.

    Walks the network backwards with integer index intervals: a chunk padded by this much on each
    side and trimmed reproduces offline synthesis.
    """
    widest = [
        max(resblock_reach(config, k, d) for k, d in stage) for stage in config.stage_blocks()
    ]
    frame = 1_000  # any frame away from the edges
    edge = (EDGE_KERNEL - 1) // 2
    lo, hi = frame * config.hop_size - edge, (frame + 1) * config.hop_size - 1 + edge  # conv_post
    stages = zip(config.upsample_rates, config.upsample_kernel_sizes, widest)
    for u, k, reach in reversed(list(stages)):
        lo, hi = lo - reach, hi + reach
        p = (k - u) // 2
        # output n of a transposed conv reads inputs j with n + p - k < j*u <= n + p
        lo, hi = -((-(lo + p - k + 1)) // u), (hi + p) // u
    lo, hi = lo - edge, hi + edge  # conv_pre
    return frame - lo, hi - frame


def conv(layer: nn.Conv1d, x: torch.Tensor, padding: int) -> torch.Tensor:
    """`layer`'s convolution with its own weights: 1-D on `[B, C, T]`, or the same arithmetic as
    a height-1 2-D conv on `[B, C, 1, T]` (the layout ONNX Runtime's CPU provider runs fastest)."""
    w, d = layer.weight, layer.dilation[-1]
    if x.dim() == 3:
        return F.conv1d(x, w, layer.bias, padding=padding, dilation=d)
    packed = getattr(layer, "packed_weight", None)
    if callable(packed):  # runs the conv itself: int8, or observed for int8's calibration
        return packed(x, padding)
    if packed is not None:
        return onednn_conv.conv2d(x, packed, layer.bias, padding, d)
    return F.conv2d(x, w.unsqueeze(2), layer.bias, padding=(0, padding), dilation=(1, d))


def conv_transpose(layer: nn.ConvTranspose1d, x: torch.Tensor, padding: int) -> torch.Tensor:
    """`layer`'s transposed convolution, 1-D or height-1 2-D like `conv`."""
    w, u = layer.weight, layer.stride[-1]
    if x.dim() == 3:
        return F.conv_transpose1d(x, w, layer.bias, stride=u, padding=padding)
    packed = getattr(layer, "packed_weight", None)
    if packed is not None:
        return onednn_conv.conv_transpose2d(x, packed, layer.bias, padding, u)
    return F.conv_transpose2d(x, w.unsqueeze(2), layer.bias, stride=(1, u), padding=(0, padding))


def padding_of(layer: nn.Module) -> int:
    """A convolution's (symmetric, numeric) padding along time."""
    padding = layer.padding
    assert isinstance(padding, tuple) and isinstance(padding[-1], int), padding
    return padding[-1]


def activated(x: torch.Tensor, slope: float | None) -> torch.Tensor:
    """Leaky ReLU of negative slope `slope` (None: `x` as it is)."""
    return x if slope is None else F.leaky_relu(x, slope)


class Offline:
    """How the generator's layers run on a whole utterance: every convolution zero-padded on
    both sides. The stateful streaming rendering (`streaming.Streaming`) has the same methods."""

    def conv(self, layer: nn.Module, x: torch.Tensor, slope: float | None = None) -> torch.Tensor:
        """`layer` on `x`, after a leaky ReLU of negative slope `slope` where one is given."""
        return conv(cast(nn.Conv1d, layer), activated(x, slope), padding_of(layer))

    def conv_transpose(
        self, layer: nn.Module, x: torch.Tensor, slope: float | None = None
    ) -> torch.Tensor:
        return conv_transpose(
            cast(nn.ConvTranspose1d, layer), activated(x, slope), padding_of(layer)
        )

    def residual(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x + t

    def average(self, branches: list[torch.Tensor], lagging: int) -> torch.Tensor:
        """Mean of a stage's residual blocks (`lagging`: the one with the widest reach)."""
        return sum(branches[1:], branches[0]) / len(branches)


OFFLINE = Offline()


class ResBlock1(nn.Module):
    """Pairs of (dilated conv, plain conv) with a residual around each pair."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(
                nn.Conv1d(
                    channels, channels, kernel_size, dilation=d, padding=(kernel_size - 1) * d // 2
                )
            )
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2))
            for _ in dilations
        )

    def forward(self, x: torch.Tensor, layers: Offline = OFFLINE) -> torch.Tensor:
        for c1, c2 in zip(self.convs1, self.convs2):
            t = layers.conv(c1, x, LRELU_SLOPE)
            x = layers.residual(x, layers.conv(c2, t, LRELU_SLOPE))
        return x


class ResBlock2(nn.Module):
    """Dilated convs with a residual around each (the V3 block)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs = nn.ModuleList(
            weight_norm(
                nn.Conv1d(
                    channels, channels, kernel_size, dilation=d, padding=(kernel_size - 1) * d // 2
                )
            )
            for d in dilations
        )

    def forward(self, x: torch.Tensor, layers: Offline = OFFLINE) -> torch.Tensor:
        for c in self.convs:
            x = layers.residual(x, layers.conv(c, x, LRELU_SLOPE))
        return x


class Generator(nn.Module):
    """Mel `[B, num_mels, frames]` -> audio `[B, 1, frames * hop_size]` in [-1, 1].

    The one definition of the network. `layers` says how each layer runs: `OFFLINE` (zero
    padding, the whole utterance at once) or `streaming.Streaming` (chunk by chunk, each layer
    carrying its input tail). Both accept `[B, C, 1, T]` too (height-1 2-D convs, for export).
    """

    def __init__(self, config: HifiGanConfig):
        super().__init__()
        self.config = config
        ch = config.upsample_initial_channel
        self.conv_pre = weight_norm(
            nn.Conv1d(config.num_mels, ch, EDGE_KERNEL, padding=(EDGE_KERNEL - 1) // 2)
        )
        block = ResBlock1 if config.resblock == "1" else ResBlock2
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()  # every stage's blocks, stage after stage
        self.stage_slices: list[slice] = []
        self.lagging: list[int] = []  # each stage's block whose output a stream has least of
        stages = zip(config.upsample_rates, config.upsample_kernel_sizes, config.stage_blocks())
        for i, (u, k, blocks) in enumerate(stages):
            c_in, c_out = ch // 2**i, ch // 2 ** (i + 1)
            self.ups.append(
                weight_norm(nn.ConvTranspose1d(c_in, c_out, k, u, padding=(k - u) // 2))
            )
            start = len(self.resblocks)
            for k_rb, d in blocks:
                self.resblocks.append(block(c_out, k_rb, d))
            self.stage_slices.append(slice(start, len(self.resblocks)))
            reach = [resblock_reach(config, k_rb, d) for k_rb, d in blocks]
            self.lagging.append(reach.index(max(reach)))
        self.conv_post = weight_norm(
            nn.Conv1d(c_out, 1, EDGE_KERNEL, padding=(EDGE_KERNEL - 1) // 2)
        )

    @property
    def hop_size(self) -> int:
        return self.config.hop_size

    @property
    def receptive_field(self) -> tuple[int, int]:
        """(left, right) context in mel frames needed for exact chunked synthesis."""
        return receptive_field_frames(self.config)

    def forward(self, mel: torch.Tensor, layers: Offline = OFFLINE) -> torch.Tensor:
        x = layers.conv(self.conv_pre, mel)
        for i, up in enumerate(self.ups):
            x = layers.conv_transpose(up, x, LRELU_SLOPE)
            blocks = self.resblocks[self.stage_slices[i]]
            x = layers.average([b(x, layers) for b in blocks], self.lagging[i])
        # the reference uses leaky_relu's default slope (0.01) here, not LRELU_SLOPE
        x = layers.conv(self.conv_post, x, 0.01)
        return torch.tanh(x)

    def remove_weight_norm(self) -> Generator:
        """Fold weight norm into plain weights (for inference and export); idempotent."""
        for m in self.modules():
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
        return self

    def pack_for_onednn(self) -> Generator:
        """Pack every convolution's weight into oneDNN's layout for `[B, C, 1, T]` inputs (best
        in channels-last layout; a conv's once per width class of outputs): a plain 2-D conv
        re-blocks its weight on every call, which on short streaming chunks costs more than the
        convolution (`kernels.onednn_conv`).
        CPU only; call after `remove_weight_norm` and the final `.to(dtype)`. 1-D inputs keep
        the plain weights; the packed ones are not part of the state dict."""
        for m in self.modules():
            if isinstance(m, nn.Conv1d):
                packed = onednn_conv.pack_conv_weight(m.weight.unsqueeze(2), m.dilation[-1])
                m.packed_weight = packed  # type: ignore[assignment]  # one per width class met
            elif isinstance(m, nn.ConvTranspose1d):
                m.packed_weight = onednn_conv.pack_conv_transpose_weight(
                    m.weight.unsqueeze(2), m.stride[-1]
                )
        return self

    @property
    def has_weight_norm(self) -> bool:
        return any(parametrize.is_parametrized(m, "weight") for m in self.modules())
