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
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from itertools import cycle
from pathlib import Path
from typing import Any

import numpy as np

from vocoder_service.hifigan import HifiGanConfig

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


def fp32_nodes(model: Any, config: HifiGanConfig, keep: int) -> list[str]:
    """Names of the convolution nodes that stay fp32 in an export of the generator: all but
    the residual blocks of the first `stages - keep` upsampling stages (its upsamplers are the
    ConvTranspose nodes, its residual blocks' nodes are named `.../resblocks.J/...`, conv_pre
    is the first Conv and conv_post the last)."""
    check_fp32_stages(config, keep)
    stages, kernels = len(config.upsample_rates), len(config.resblock_kernel_sizes)
    nodes = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    ups = [n.name for n in nodes if n.op_type == "ConvTranspose"]
    if len(ups) != stages:
        raise ValueError(f"expected {stages} ConvTranspose nodes, found {len(ups)}")
    int8_blocks = (stages - keep) * kernels

    def int8(name: str) -> bool:
        return "resblocks." in name and int(name.split("resblocks.")[1].split("/")[0]) < int8_blocks

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
        state, start, sizes = initial_state, 0, cycle(CALIBRATION_CHUNKS)
        n = lag + 1
        while True:
            part = np.ascontiguousarray(mel[:, :, start : start + n], dtype=np.float32)
            start += n
            feed = {"mel": part, **dict(zip(names, state))}
            if start >= mel.shape[-1]:
                finals.append(feed)
                break
            steps.append(feed)
            _, *state = step.run(None, feed)
            n = next(sizes)
    return steps, finals
