"""The generator's ONNX graphs in int8: ONNX Runtime's static quantisation, calibrated on the
voice's own speech.

Only the residual blocks' convolutions, in QDQ form: per-channel int8 weights, uint8 activations
at each convolution's input with ranges (MinMax) seen on calibration mels; the sums and
activations between them run in float on values rounded to the 8-bit grid of the convolutions
that read them. conv_pre, the upsamplers, the residual blocks of the last `fp32_stages` stages
(nearest to audio) and conv_post stay fp32. On the default voice, streamed, that held WER
within 0.4 points and DNSMOS within 0.03 of fp32 at 0.46x its CPU time; keeping only the last
stage and conv_post fp32 cost as much time with 40% more log-mel error (1.5 points of WER), and
int8 everywhere doubled the WER (bench/README.md).

A streaming graph is calibrated on what it meets in service: its step graph on the calls of
streams run chunk by chunk through the fp32 step graph (carried state included, chunks of
`CALIBRATION_CHUNKS` frames), its final graph on those streams' last calls.

The torch generator takes the same residual blocks to int8 on oneDNN (`quantize_generator`,
`kernels.onednn_conv.QuantizedConv`), the rest of it staying bf16: each convolution's input
range is measured on the same streamed calls, through the bf16 generator itself.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import cycle
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from torch import nn

from vocoder_service.hifigan import Generator, HifiGanConfig

if TYPE_CHECKING:
    from kernels.onednn_conv import PackedConv

# the new frames of each calibration call after a stream's first (which takes the lag + 1):
# the range of sizes the chunk policy gives (`chunking.py`)
CALIBRATION_CHUNKS = (4, 8, 16, 32, 64)
FP32_STAGES = 1
# bump when what is quantised, or how, changes: cached graphs are keyed by it
QUANTIZATION_VERSION = 2


def check_fp32_stages(config: HifiGanConfig, fp32_stages: int) -> None:
    stages = len(config.upsample_rates)
    if not 0 <= fp32_stages <= stages:
        raise ValueError(
            f"fp32_stages must be in [0, {stages}], the generator's upsampling stages "
            f"(got {fp32_stages})"
        )


def int8_blocks(config: HifiGanConfig, keep: int) -> int:
    """How many of the generator's residual blocks (`Generator.resblocks`, in order) run int8:
    those of the first `stages - keep` upsampling stages."""
    check_fp32_stages(config, keep)
    stages = config.stage_blocks()
    return sum(len(blocks) for blocks in stages[: len(stages) - keep])


def calibration_key(calibration: Sequence[np.ndarray], fp32_stages: int) -> str:
    """What an int8 generator's quantisation depends on besides its checkpoint: the version,
    the stages kept fp32 and the calibration mels."""
    key = hashlib.sha256(f"{QUANTIZATION_VERSION} {fp32_stages}".encode())
    for mel in calibration:
        key.update(repr(mel.shape).encode())
        key.update(np.ascontiguousarray(mel, dtype=np.float32).tobytes())
    return key.hexdigest()[:12]


def calibration_calls(mel: np.ndarray, lag: int) -> Iterator[tuple[np.ndarray, bool]]:
    """`mel` `[1, num_mels, frames]` cut as the service streams it: (new frames, final) of each
    call, the first `lag + 1` frames long, then `CALIBRATION_CHUNKS` in turn."""
    start, sizes, n = 0, cycle(CALIBRATION_CHUNKS), lag + 1
    while True:
        part = np.ascontiguousarray(mel[:, :, start : start + n], dtype=np.float32)
        start += n
        yield part, start >= mel.shape[-1]
        if start >= mel.shape[-1]:
            return
        n = next(sizes)


def fp32_nodes(model: Any, config: HifiGanConfig, keep: int) -> list[str]:
    """Names of the convolution nodes that stay fp32 in an export of the generator: all but
    those of the first `int8_blocks` residual blocks (its upsamplers are the ConvTranspose
    nodes, its residual blocks' nodes are named `.../resblocks.J/...`, conv_pre is the first
    Conv and conv_post the last)."""
    blocks = int8_blocks(config, keep)
    stages = len(config.upsample_rates)
    nodes = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    ups = [n.name for n in nodes if n.op_type == "ConvTranspose"]
    if len(ups) != stages:
        raise ValueError(f"expected {stages} ConvTranspose nodes, found {len(ups)}")

    def int8(name: str) -> bool:
        return "resblocks." in name and int(name.split("resblocks.")[1].split("/")[0]) < blocks

    return [n.name for n in nodes if not int8(n.name)]


def quantize_graph(
    src: Path,
    out: Path,
    feeds: Iterable[dict[str, np.ndarray]],
    config: HifiGanConfig,
    fp32_stages: int = FP32_STAGES,
) -> Path:
    """Static QDQ quantisation of a generator export (offline or streaming), calibrated on
    `feeds` (the graph's inputs by name); written atomically to `out`."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter(feeds)

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        pre, quantized = Path(tmp) / "pre.onnx", Path(tmp) / "int8.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        quantize_static(
            str(pre),
            str(quantized),
            Reader(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["Conv", "ConvTranspose"],
            nodes_to_exclude=fp32_nodes(onnx.load(str(pre)), config, fp32_stages),
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
        os.chmod(quantized, 0o644)
        os.replace(quantized, out)  # concurrent writers of the same key write identical files
    return out


def stream_feeds(
    step: Any,
    mels: Sequence[np.ndarray],
    initial_state: list[np.ndarray],
    lag: int,
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """Each mel `[1, num_mels, frames]` streamed through the fp32 step graph's session (ONNX
    Runtime) as the service streams it, from `initial_state`; returns the inputs of the step
    calls and of each stream's final call."""
    names = [i.name for i in step.get_inputs()][1:]
    steps, finals = [], []
    for mel in mels:
        state = initial_state
        for part, final in calibration_calls(mel, lag):
            feed = {"mel": part, **dict(zip(names, state))}
            if final:
                finals.append(feed)
                break
            steps.append(feed)
            _, *state = step.run(None, feed)
    return steps, finals


class _Observed:
    """A convolution's packed weight during calibration: runs the conv as before and widens
    the range seen at its input (`hifigan.conv` calls a callable packed weight)."""

    def __init__(self, layer: nn.Conv1d):
        self.layer = layer
        self.packed = cast("PackedConv", layer.packed_weight)
        self.low, self.high = 0.0, 0.0  # the grid always holds 0: padding and silence

    def __call__(self, x, padding: int):
        from kernels import onednn_conv

        self.low, self.high = min(self.low, float(x.min())), max(self.high, float(x.max()))
        return onednn_conv.conv2d(x, self.packed, self.layer.bias, padding, self.layer.dilation[-1])


def quantize_generator(
    generator: Generator,
    run_stream: Callable[[np.ndarray, Any, bool], tuple[Any, Any]],
    mels: Sequence[np.ndarray],
    fp32_stages: int = FP32_STAGES,
    ranges: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Put the convolutions of the generator's first `int8_blocks` residual blocks on int8
    (`QuantizedConv`), on weights packed for oneDNN (`Generator.pack_for_onednn`). Each one's
    input range (MinMax, uint8) is measured by streaming `mels` through `run_stream`
    (`Backend.run_stream` of this generator) as `calibration_calls` cuts them, unless `ranges`
    gives them. Returns the ranges by module name (to cache)."""
    from kernels.onednn_conv import QuantizedConv

    blocks = generator.resblocks[: int8_blocks(generator.config, fp32_stages)]
    convs = {
        f"resblocks.{i}.{name}": m
        for i, block in enumerate(blocks)
        for name, m in block.named_modules()
        if isinstance(m, nn.Conv1d)
    }
    if ranges is None:
        observed = {name: _Observed(m) for name, m in convs.items()}
        for name, m in convs.items():
            m.packed_weight = observed[name]  # type: ignore[assignment]
        lag = generator.receptive_field[1]
        try:
            for mel in mels:
                state = None
                for part, final in calibration_calls(mel, lag):
                    _, state = run_stream(part, state, final)
        finally:
            for name, m in convs.items():
                m.packed_weight = observed[name].packed  # type: ignore[assignment]
        ranges = {name: [o.low, o.high] for name, o in observed.items()}
    if set(ranges) != set(convs):
        raise ValueError("the cached int8 ranges are not this generator's convolutions")
    for name, m in convs.items():
        low, high = ranges[name]
        scale = (high - low) / 255 or 1.0
        m.packed_weight = QuantizedConv(  # type: ignore[assignment]
            m.weight.unsqueeze(2),
            m.bias,
            m.dilation[-1],
            scale,
            min(255, max(0, round(-low / scale))),
        )
    return ranges
