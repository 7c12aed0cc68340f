"""HiFi-GAN run chunk by chunk, each layer carrying the tail of its input between calls.

Offline synthesis pads every convolution with zeros on both sides. Here every layer instead
keeps the last input samples its kernel still needs and computes only the outputs whose whole
kernel span has arrived, so a chunk costs only its new samples (no recomputed context), and the
concatenated output equals offline synthesis up to float rounding. The price is a fixed lag:
the audio of the last ~`receptive_field[1]` frames comes out with the next chunk, or with the
final call, which pads every layer's input with the zeros offline synthesis would have seen.

All state is plain tensors passed in and returned, so the same graph exports to ONNX with the
state as inputs and outputs. Uniform rules handle the first call, steady calls and the last:

- conv (half width h): state starts as h zeros (the left padding) and then keeps 2h samples;
  each call outputs `len(state) + new - 2h` samples (the final call appends h zeros).
- transposed conv (stride u, kernel k, padding p): state keeps the last ceil(k/u) - 1 input
  columns (zeros at first); each call outputs `new * u` samples of the unpadded output, of
  which the very first p are dropped (a `skip` tensor whose length is what is left to drop).
- residual sums and the averaged multi-receptive-field blocks: the branch that lags less keeps
  its extra samples until the other has caught up (buffers start empty).

Tensors are `[B, C, 1, T]`: height-1 2-D convs, which ONNX Runtime's CPU provider runs in its
blocked layout (see `backends._as_conv2d`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vocoder_service.hifigan import LRELU_SLOPE, Generator, ResBlock1, ResBlock2


class _Layer:
    """A conv's weights as height-1 2-D kernels."""

    def __init__(self, conv: Any):  # a generator's (transposed) conv, 1-D or as 2-D
        w = conv.weight.detach()
        self.weight = w if w.dim() == 4 else w.unsqueeze(2)
        self.bias = conv.bias.detach()


class _Conv(_Layer):
    def __init__(self, conv: Any):
        super().__init__(conv)
        self.dilation = conv.dilation[-1]
        self.half = (conv.kernel_size[-1] - 1) * self.dilation // 2

    def initial(self, batch: int, dtype, device) -> Tensor:
        return torch.zeros(batch, self.weight.shape[1], 1, self.half, dtype=dtype, device=device)

    def __call__(self, x: Tensor, state: Tensor, final: bool, out: list[Tensor]) -> Tensor:
        xc = torch.cat([state, x], -1)
        out.append(_tail(xc, 2 * self.half))
        if final:
            xc = F.pad(xc, (0, self.half))
        return F.conv2d(xc, self.weight, self.bias, dilation=(1, self.dilation))


class _ConvTranspose(_Layer):
    def __init__(self, conv: Any):
        super().__init__(conv)
        self.stride = conv.stride[-1]
        self.padding = int(conv.padding[-1])
        self.history = math.ceil(conv.kernel_size[-1] / self.stride) - 1  # input columns kept

    def initial(self, batch: int, dtype, device) -> list[Tensor]:
        cols = torch.zeros(batch, self.weight.shape[0], 1, self.history, dtype=dtype, device=device)
        skip = torch.zeros(1, 1, 1, self.padding, dtype=dtype, device=device)
        return [cols, skip]

    def __call__(self, x: Tensor, state: Tensor, skip: Tensor, final: bool,
                 out: list[Tensor]) -> Tensor:
        new = x.shape[-1]
        xc = torch.cat([state, x], -1)
        out += [_tail(xc, self.history), skip[..., :0]]
        if final:
            xc = F.pad(xc, (0, self.history))
        y = F.conv_transpose2d(xc, self.weight, self.bias, stride=(1, self.stride))
        start = self.history * self.stride  # outputs before this were emitted last call
        end = start + new * self.stride + (self.padding if final else 0)
        return y[..., start + skip.shape[-1]:end]


def _align(branches: list[Tensor], buffers: list[Tensor], lagging: int,
           out: list[Tensor]) -> list[Tensor]:
    """Cut branches that ran ahead to the length of the one that lags most; keep the rest."""
    joined = [torch.cat([b, x], -1) for b, x in zip(buffers, branches)]
    length = joined[lagging].shape[-1]
    for j in joined:
        out.append(j[..., length:])
    return [j[..., :length] for j in joined]


class StreamingGenerator(nn.Module):
    """`forward(mel, state, final)` -> (audio `[B, samples]`, next state).

    `mel` holds only new frames `[B, num_mels, 1, frames]`. A non-final call needs at least one
    frame, and the first needs enough to get through every layer: `receptive_field[1] + 1`.
    The final call takes any number, none included.
    """

    def __init__(self, generator: Generator):
        super().__init__()
        g = generator
        self.config = g.config
        self.num_kernels = g.num_kernels
        self.conv_pre = _Conv(g.conv_pre)
        self.conv_post = _Conv(g.conv_post)
        self.ups = [_ConvTranspose(u) for u in g.ups]
        self.blocks: list[list[list[_Conv]]] = []  # per resblock: list of residual units, each a list of convs
        for rb in g.resblocks:
            if isinstance(rb, ResBlock1):
                self.blocks.append([[_Conv(c1), _Conv(c2)] for c1, c2 in zip(rb.convs1, rb.convs2)])
            elif isinstance(rb, ResBlock2):
                self.blocks.append([[_Conv(c)] for c in rb.convs])
        # within a stage the block with the widest kernels lags most
        lags = [sum(c.half for unit in b for c in unit) for b in self.blocks[:self.num_kernels]]
        self.lagging = lags.index(max(lags))

    def initial_state(self, batch: int = 1, dtype=torch.float32, device="cpu") -> list[Tensor]:
        """The state before the first frame: left zero padding, empty buffers."""
        state = [self.conv_pre.initial(batch, dtype, device)]
        for i, up in enumerate(self.ups):
            state += up.initial(batch, dtype, device)
            channels = up.weight.shape[1]
            for block in self.blocks[i * self.num_kernels:(i + 1) * self.num_kernels]:
                for unit in block:
                    state += [c.initial(batch, dtype, device) for c in unit]
                    state.append(torch.zeros(batch, channels, 1, 0, dtype=dtype, device=device))
            state += [torch.zeros(batch, channels, 1, 0, dtype=dtype, device=device)
                      for _ in range(self.num_kernels)]
        state.append(self.conv_post.initial(batch, dtype, device))
        return state

    def forward(self, mel: Tensor, state: list[Tensor], final: bool = False
                ) -> tuple[Tensor, list[Tensor]]:
        it, out = iter(state), list[Tensor]()
        x = self.conv_pre(mel, next(it), final, out)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, LRELU_SLOPE), next(it), next(it), final, out)
            branches = []
            for block in self.blocks[i * self.num_kernels:(i + 1) * self.num_kernels]:
                y = x
                for unit in block:
                    t = y
                    for conv in unit:
                        t = conv(F.leaky_relu(t, LRELU_SLOPE), next(it), final, out)
                    y = _residual(next(it), y, t, out)
                branches.append(y)
            stage_buffers = [next(it) for _ in range(self.num_kernels)]
            branches = _align(branches, stage_buffers, self.lagging, out)
            x = sum(branches[1:], branches[0]) / self.num_kernels
        x = self.conv_post(F.leaky_relu(x, 0.01), next(it), final, out)
        return torch.tanh(x)[:, 0, 0], out


def _residual(rest: Tensor, x: Tensor, t: Tensor, out: list[Tensor]) -> Tensor:
    """x + t where t lags x: the part of x that t has not reached yet waits in `rest`."""
    xc = torch.cat([rest, x], -1)
    length = t.shape[-1]
    out.append(xc[..., length:])
    return xc[..., :length] + t


def _tail(x: Tensor, n: int) -> Tensor:
    """The last n samples (all of them when there are fewer)."""
    return x[..., -n:] if n else x[..., :0]
