"""HiFi-GAN run chunk by chunk, each layer carrying the tail of its input between calls.

Offline synthesis pads every convolution with zeros on both sides. Here every layer instead
keeps the last input samples its kernel still needs and computes only the outputs whose whole
kernel span has arrived, so a chunk costs only its new samples (no recomputed context), and the
concatenated output equals offline synthesis up to float rounding. The price is a fixed lag:
the audio of the last ~`receptive_field[1]` frames comes out with the next chunk, or with the
final call, which pads every layer's input with the zeros offline synthesis would have seen.

The network is `hifigan.Generator`'s own forward; `Streaming` only says how each kind of layer
runs. All state is plain tensors passed in and returned, in the order the forward meets the
layers, so the same graph exports to ONNX with the state as inputs and outputs. Uniform rules
handle the first call, steady calls and the last:

- conv (half width h): state starts as h zeros (the left padding) and then keeps 2h samples;
  each call outputs `len(state) + new - 2h` samples (the final call appends h zeros).
- transposed conv (stride u, kernel k, padding p): state keeps the last ceil(k/u) - 1 input
  columns (zeros at first); each call outputs `new * u` samples of the unpadded output, of
  which the very first p are dropped (a `skip` tensor whose length is what is left to drop).
- residual sums and the averaged multi-receptive-field blocks: the branch that lags less keeps
  its extra samples until the other has caught up (buffers start empty).

Tensors are `[B, C, 1, T]`: height-1 2-D convs, which ONNX Runtime's CPU provider runs in its
blocked layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import cast

import torch
from torch import Tensor, nn

from kernels import cpu_ext
from vocoder_service.hifigan import (
    Generator,
    HifiGanConfig,
    activated,
    conv,
    conv_transpose,
    padding_of,
)


class Streaming:
    """One call's rendering of the layers: reads each layer's carried state in forward order
    (`state` None: a fresh stream, each layer starts from its initial state, collected in
    `initial_state`) and collects the state for the next call in `next_state`."""

    def __init__(self, state: list[Tensor] | None, final: bool):
        self._state = None if state is None else iter(state)
        self.final = final
        self.next_state: list[Tensor] = []
        self.initial_state: list[Tensor] = []

    def _carried(self, initial: Callable[[], Tensor]) -> Tensor:
        if self._state is not None:
            return next(self._state)
        self.initial_state.append(initial())
        return self.initial_state[-1]

    def conv(self, layer: nn.Module, x: Tensor, slope: float | None = None) -> Tensor:
        half = padding_of(layer)
        xc, tail = _joined(self._carried(lambda: _zeros(x, half)), x, slope, keep=2 * half)
        self.next_state.append(tail)
        if self.final:
            xc = torch.nn.functional.pad(xc, (0, half))
        return conv(cast(nn.Conv1d, layer), xc, 0)

    def conv_transpose(self, module: nn.Module, x: Tensor, slope: float | None = None) -> Tensor:
        layer = cast(nn.ConvTranspose1d, module)
        stride, padding = layer.stride[-1], padding_of(layer)
        history = math.ceil(layer.kernel_size[-1] / stride) - 1  # input columns kept
        new = x.shape[-1]
        xc, tail = _joined(self._carried(lambda: _zeros(x, history)), x, slope, keep=history)
        skip = self._carried(lambda: x.new_zeros((1,) * (x.dim() - 1) + (padding,)))
        self.next_state += [tail, _compact(skip[..., :0])]
        if self.final:
            xc = torch.nn.functional.pad(xc, (0, history))
        y = conv_transpose(layer, xc, 0)
        start = history * stride  # outputs before this were emitted last call
        end = start + new * stride + (padding if self.final else 0)
        return y[..., start + skip.shape[-1] : end]

    def residual(self, x: Tensor, t: Tensor) -> Tensor:
        """x + t where t lags x: the part of x that t has not reached yet waits in the state.
        The sum is written over t (a convolution's output, used only here)."""
        carried = self._carried(lambda: _zeros(x, 0))
        length = t.shape[-1]
        if torch.jit.is_tracing():
            xc, _ = _joined(carried, x)
            self.next_state.append(xc[..., length:])
            return xc[..., :length] + t
        total, rest = cpu_ext.add_joined_(t, carried, x)
        self.next_state.append(rest)
        return total

    def average(self, branches: list[Tensor], lagging: int) -> Tensor:
        """Cut branches that ran ahead to the length of the one that lags most; keep the rest."""
        buffers = [self._carried(partial(_zeros, b, 0)) for b in branches]
        if torch.jit.is_tracing():
            joined = [_joined(buf, b)[0] for buf, b in zip(buffers, branches)]
            length = joined[lagging].shape[-1]
            self.next_state += [j[..., length:] for j in joined]
            return sum((j[..., :length] for j in joined[1:]), joined[0][..., :length]) / len(joined)
        length = buffers[lagging].shape[-1] + branches[lagging].shape[-1]
        mean, rests = cpu_ext.mean_joined(buffers, branches, length)
        self.next_state += rests
        return mean


class StreamingGenerator(nn.Module):
    """`forward(mel, state, final)` -> (audio `[B, samples]`, next state).

    `mel` holds only new frames `[B, num_mels, 1, frames]`; `state` None starts a stream. A
    non-final call needs at least one frame, and the first needs enough to get through every
    layer: `receptive_field[1] + 1`. The final call takes any number, none included (after a
    first call).
    """

    def __init__(self, generator: Generator):
        super().__init__()
        self.generator = generator
        self.config = generator.config

    def forward(
        self, mel: Tensor, state: list[Tensor] | None = None, final: bool = False
    ) -> tuple[Tensor, list[Tensor]]:
        layers = Streaming(state, final)
        audio = self.generator(mel, layers)
        return audio[:, 0, 0], layers.next_state

    def initial_state(self, batch: int = 1, dtype=torch.float32, device="cpu") -> list[Tensor]:
        """The state before the first frame (what `state=None` starts from)."""
        return initial_state(self.config, batch, dtype, device)


def initial_state(
    config: HifiGanConfig, batch: int = 1, dtype=torch.float32, device="cpu"
) -> list[Tensor]:
    """The state a fresh stream starts from, in the order the forward reads it (found by running
    the forward on shapes alone)."""
    with torch.device("meta"):
        skeleton = StreamingGenerator(Generator(config))
        mel = torch.zeros(batch, config.num_mels, 1, config.receptive_field[1] + 1)
        layers = Streaming(None, final=False)
        skeleton.generator(mel, layers)
    return [torch.zeros(t.shape, dtype=dtype, device=device) for t in layers.initial_state]


def _channels_last(x: Tensor) -> bool:
    """Whether `x` is `[B, C, 1, T]` in channels-last layout, told by its strides (channels
    innermost, then time), which a tensor one sample long made channels last also has."""
    return x.dim() == 4 and x.shape[1] > 1 and x.stride(1) == 1 and x.stride(3) == x.shape[1]


def _zeros(like: Tensor, length: int) -> Tensor:
    """Zeros shaped like `like` but `length` long, in its memory layout."""
    fmt = torch.channels_last if _channels_last(like) else torch.contiguous_format
    return torch.empty(
        (*like.shape[:-1], length), dtype=like.dtype, device=like.device, memory_format=fmt
    ).zero_()


def _joined(
    first: Tensor, then: Tensor, slope: float | None = None, keep: int = 0
) -> tuple[Tensor, Tensor]:
    """`first` then `then` along time, `then` through a leaky ReLU of negative slope `slope`
    where one is given (a layer's carried input is kept activated): one pass over `then`. With
    the join, its last `keep` samples (the layer's state for the next call) in storage of their
    own (`_compact`).

    Channels last where either part is: `torch.cat` gives its result the first input's
    layout, plain for an empty or one-sample tensor, and every convolution after a plain one
    converted its input back (on the CPU in bf16, a third of a streamed call's time). An empty
    part is skipped, not copied. An exported graph always joins: its buffers' lengths are
    inputs, not constants."""
    if torch.jit.is_tracing():
        joined = torch.cat([first, activated(then, slope)], -1)
        return joined, _tail(joined, keep)
    if not first.shape[-1]:
        joined = activated(then, slope)
    elif not then.shape[-1]:
        joined = first
    elif not (_channels_last(first) or _channels_last(then)):
        joined = torch.cat([first, activated(then, slope)], -1)
    else:
        return cpu_ext.join_channels_last(first, then, slope, keep)
    return joined, _compact(_tail(joined, keep))


def _compact(x: Tensor) -> Tensor:
    """A carried tail in storage of its own, in its layout. Tails are cut from a call's
    activations; kept as views they would keep every activation of the forward alive to its end
    and then until the stream's next call: for a bf16 HiFi-GAN V1 stream in 32-frame chunks,
    tens of MB held for some 400 KB of state, each activation written to memory not in any
    cache, and pages faulted in afresh by many forwards (bench/README.md, "The vocoder's memory
    traffic per call")."""
    if x.dim() == 4 and _channels_last(x):
        return x.clone(memory_format=torch.channels_last)
    return x.clone(memory_format=torch.contiguous_format)


def _tail(x: Tensor, n: int) -> Tensor:
    """The last n samples (all of them when there are fewer)."""
    return x[..., -n:] if n else x[..., :0]
