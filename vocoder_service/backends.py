"""Generator backends: torch on any device, and ONNX Runtime over a cached export."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from kernels import onednn_conv
from vocoder_service.checkpoint import GeneratorCheckpoint, load_generator, resolve_checkpoint
from vocoder_service.chunking import ForwardShape
from vocoder_service.hifigan import Generator, HifiGanConfig
from vocoder_service.quantize import (
    FP32_STAGES,
    calibration_key,
    check_fp32_stages,
    quantize_generator,
    quantize_graph,
    stream_feeds,
)
from vocoder_service.streaming import StreamingGenerator, initial_state

log = logging.getLogger(__name__)

ONNX_OPSET = 17
_EXPORT_VERSION = 4  # bump when the exported graph changes, so stale cache entries are not reused
GRAPH_OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")


def default_cache_dir() -> Path:
    """`$SPLITTTS_CACHE/onnx`, else `~/.cache/split-tts/onnx`."""
    root = os.environ.get("SPLITTTS_CACHE") or "~/.cache/split-tts"
    return Path(root).expanduser() / "onnx"


class Backend:
    """Runs the generator: mel `[B, num_mels, frames]` float32 -> audio `[B, frames * hop]` float32."""

    name = "base"
    config: HifiGanConfig

    @property
    def hop_size(self) -> int:
        return self.config.hop_size

    @property
    def num_mels(self) -> int:
        return self.config.num_mels

    @property
    def sample_rate(self) -> int:
        return self.config.sampling_rate

    @property
    def receptive_field(self) -> tuple[int, int]:
        """(left, right) mel frames of context for exact chunked synthesis."""
        return self.config.receptive_field

    @property
    def device(self) -> str:
        raise NotImplementedError

    @property
    def precision(self) -> str:
        """ "fp32", "fp16", "bf16" or "int8": what the generator computes in ("int8": the
        convolutions `quantize.py` chooses, on 8-bit weights and inputs)."""
        raise NotImplementedError

    def run(self, mel: np.ndarray | torch.Tensor) -> np.ndarray:
        """Vocode a batch of equal-length mel windows in one forward."""
        raise NotImplementedError

    def run_stream(
        self, mel: np.ndarray, state: list | None, final: bool = False
    ) -> tuple[np.ndarray, list]:
        """One stream's next chunk through the stateful generator (see `streaming.py`).

        mel `[1, num_mels, new frames]` (only frames not sent before; 0 frames is allowed on
        the final call), `state` None at the start of a stream; returns (audio `[samples]`,
        state for the next call). The first non-final call needs at least
        `receptive_field[1] + 1` frames.
        """
        raise NotImplementedError

    def run_streams(
        self, mel: np.ndarray, states: list[list | None], final: bool = False
    ) -> tuple[list[np.ndarray], list[list]]:
        """Several streams' next chunks, as `run_stream` would give them one by one.

        mel `[B, num_mels, new frames]`: the same number of new frames for every stream, and
        `states` either all None (fresh streams) or all carried states of equal shapes. A
        backend that can stack streams into one forward does (see `TorchBackend`); this one
        runs them in turn.
        """
        self._check_streams(mel, states)
        out = [self.run_stream(mel[i : i + 1], s, final) for i, s in enumerate(states)]
        return [a for a, _ in out], [s for _, s in out]

    def warmup(self, frames: int = 16, stateful: bool = False) -> None:
        """Throw-away forwards so the first real request does not pay for allocation."""
        mel = np.zeros((1, self.num_mels, frames), dtype=np.float32)
        self.run(mel)
        if stateful:
            _, state = self.run_stream(
                np.zeros((1, self.num_mels, self.receptive_field[1] + 4), dtype=np.float32), None
            )
            self.run_stream(mel, state, final=True)

    @property
    def compiles_per_shape(self) -> bool:
        """Whether the first forward of each input shape pays for compiling it (oneDNN's
        primitives on the CPU), so that a service warms the shapes its streams will use."""
        return False

    def warmup_shapes(self, shapes: list[ForwardShape]) -> None:
        """A throw-away stateful forward of each shape (`ChunkPolicy.stateful_shapes`)."""
        lag = self.receptive_field[1]
        _, state = self.run_stream(np.zeros((1, self.num_mels, lag + 1), np.float32), None)
        for shape in shapes:
            mel = np.zeros((shape.streams, self.num_mels, shape.frames), np.float32)
            self.run_streams(mel, [None if shape.fresh else state] * shape.streams, shape.final)

    def _check_streams(self, mel: np.ndarray, states: list) -> None:
        if mel.ndim != 3 or mel.shape[:2] != (len(states), self.num_mels):
            raise ValueError(
                f"mel must be [{len(states)}, {self.num_mels}, frames] (got {tuple(mel.shape)})"
            )

    def _check(self, mel: np.ndarray | torch.Tensor) -> None:
        if mel.ndim != 3 or mel.shape[1] != self.num_mels or mel.shape[2] < 1:
            raise ValueError(
                f"mel must be [batch, {self.num_mels}, frames >= 1] (got shape {tuple(mel.shape)})"
            )


class TorchBackend(Backend):
    """The torch generator on any torch device, in fp32, fp16 or bf16.

    On the CPU, bf16 runs the height-1 2-D form in channels-last layout on weights packed once
    for oneDNN (`Generator.pack_for_onednn`): where `cpu_runs_bf16_convs_fast` the fastest
    generator here. `int8` (CPU, with bf16) runs the residual blocks of all but the last
    `fp32_stages` stages on oneDNN's int8 convolutions instead, calibrated on `calibration` (mels
    `[1, num_mels, frames]`, `VocoderVoice.calibration_mels`); their input ranges are measured
    once and cached by checkpoint, calibration and stages (`cache_dir`, else
    `default_cache_dir()`).
    """

    name = "torch"

    def __init__(
        self,
        generator: Generator | GeneratorCheckpoint | str | Path | None = None,
        *,
        device: str | torch.device = "cpu",
        fp16: bool = False,
        bf16: bool = False,
        int8: bool = False,
        calibration: Sequence[np.ndarray] | None = None,
        fp32_stages: int = FP32_STAGES,
        cache_dir: str | Path | None = None,
    ):
        if fp16 and bf16:
            raise ValueError("choose one of fp16 and bf16")
        if int8 and not (bf16 and torch.device(device).type == "cpu"):
            raise ValueError("int8 runs on the CPU with the rest of the generator in bf16")
        if int8 and not calibration:
            raise ValueError("int8 needs calibration mels (a voice's calibration codes)")
        if (
            bf16
            and torch.device(device).type == "cpu"
            and not onednn_conv.packing_available(torch.bfloat16)
        ):
            raise ValueError(
                "bf16 on the CPU needs oneDNN's bf16 convolutions (AVX-512 BF16, AVX-NE-CONVERT "
                "or AMX), which this CPU lacks: run the generator in fp32"
            )
        if int8 and not onednn_conv.int8_available():
            raise ValueError(
                "int8 on torch needs oneDNN's int8 convolutions and a CPU with AVX-512 VNNI, "
                "which this one lacks"
            )
        dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
        checkpoint = None
        if not isinstance(generator, Generator):
            checkpoint = (
                generator
                if isinstance(generator, GeneratorCheckpoint)
                else resolve_checkpoint(generator)
            )
            generator = load_generator(checkpoint)
        self.generator = generator.remove_weight_norm().eval().to(device=device, dtype=dtype)
        self.config = generator.config
        self.dtype = dtype
        self.int8 = int8
        self._device = torch.device(device)
        self._channels_last = bf16 and self._device.type == "cpu"
        if self._channels_last:
            self.generator.pack_for_onednn()
        self._streamer = StreamingGenerator(self.generator)
        if int8:
            self._quantize(checkpoint, calibration or [], fp32_stages, cache_dir)

    def _quantize(
        self,
        checkpoint: GeneratorCheckpoint | None,
        mels: Sequence[np.ndarray],
        fp32_stages: int,
        cache_dir: str | Path | None,
    ) -> None:
        """Calibrate (or read the cached ranges) and put the int8 convolutions in place. A
        generator passed as a module has no checkpoint to key a cache by: calibrated afresh."""
        path = None
        if checkpoint is not None:
            cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
            key = calibration_key(mels, fp32_stages)
            path = cache / f"hifigan-{checkpoint.fingerprint[:24]}-torch-int8-{key}.json"
        ranges = json.loads(path.read_text()) if path is not None and path.is_file() else None
        if ranges is None:
            log.info("calibrating the int8 convolutions of the generator on %d mels", len(mels))
        ranges = quantize_generator(self.generator, self.run_stream, mels, fp32_stages, ranges)
        if path is not None and not path.is_file():
            with _written_atomically(path) as tmp:
                Path(tmp).write_text(json.dumps(ranges))

    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def precision(self) -> str:
        if self.int8:
            return "int8"
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.dtype, "fp32")

    @property
    def compiles_per_shape(self) -> bool:
        return self._device.type == "cpu"

    def _input(self, mel: np.ndarray | torch.Tensor) -> torch.Tensor:
        """`[B, num_mels, frames]` as the height-1 2-D input `[B, num_mels, 1, frames]`."""
        x = torch.as_tensor(mel).to(device=self._device, dtype=self.dtype).unsqueeze(2)
        return x.contiguous(memory_format=torch.channels_last) if self._channels_last else x

    def run(self, mel: np.ndarray | torch.Tensor) -> np.ndarray:
        self._check(mel)
        with torch.inference_mode():
            if self._channels_last:
                audio = self.generator(self._input(mel))[:, 0, 0]
            else:
                x = torch.as_tensor(mel).to(device=self._device, dtype=self.dtype)
                audio = self.generator(x)[:, 0]
        return audio.float().cpu().numpy()

    def run_stream(self, mel, state, final=False):
        if mel.ndim != 3 or mel.shape[:2] != (1, self.num_mels):
            raise ValueError(f"mel must be [1, {self.num_mels}, frames] (got {tuple(mel.shape)})")
        with torch.inference_mode():
            audio, state = self._streamer(self._input(mel), state, final)
        return audio[0].float().cpu().numpy(), state

    def run_streams(self, mel, states, final=False):
        """One forward for all the streams: their states stacked along the batch. A call's fixed
        cost (hundreds of small operators, about 9 ms for HiFi-GAN V1 on one CPU core) is then
        paid once for the batch, which on short chunks costs more than the convolutions."""
        self._check_streams(mel, states)
        if len(states) == 1:
            audio, state = self.run_stream(mel, states[0], final)
            return [audio], [state]
        batch = len(states)
        with torch.inference_mode():
            stacked = None
            if states[0] is not None:
                stacked = [torch.cat(parts) for parts in zip(*cast(list[list], states))]
            audio, state = self._streamer(self._input(mel), stacked, final)
            # a stream's share of each state tensor (length-only markers have a batch of 1)
            rows = [t.split(1) if t.shape[0] == batch else (t,) * batch for t in state]
        audio_np = audio.float().cpu().numpy()
        return list(audio_np), [list(parts) for parts in zip(*rows)]


class _ExportWrapper(nn.Module):
    """Fixes the exported interface to float32 `[B, frames*hop]` whatever the inner precision.

    Inside, the generator runs on `[B, C, 1, T]`: the same convolutions over a height-1 image,
    which ONNX Runtime's CPU provider rewrites into its blocked NCHWc layout (with the following
    LeakyRelu fused in), about 1.3x faster than the 1-D graph on one core.
    """

    def __init__(self, generator: Generator, fp16: bool):
        super().__init__()
        self.generator = generator
        self.fp16 = fp16

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = (mel.half() if self.fp16 else mel).unsqueeze(2)
        return self.generator(x)[:, 0, 0].float()


class _StreamExportWrapper(nn.Module):
    """`(mel, *state) -> (audio, *state)` for one stream; mel and audio float32, state in the
    compute precision. `final` is fixed per graph: the step graph and the final graph."""

    def __init__(self, generator: Generator, fp16: bool, final: bool):
        super().__init__()
        self.streamer = StreamingGenerator(generator)
        self.fp16, self.final = fp16, final

    def forward(self, mel: torch.Tensor, *state: torch.Tensor):
        x = (mel.half() if self.fp16 else mel).unsqueeze(2)
        audio, state = self.streamer(x, list(state), self.final)
        return (audio.float(), *state)


def export_onnx(
    checkpoint: GeneratorCheckpoint, path: Path, fp16: bool = False, stream: str | None = None
) -> Path:
    """Export the generator (legacy exporter, opset 17, dynamic batch and time); atomic write.

    `stream` "step" or "final" exports the stateful streaming graph instead (`streaming.py`),
    with every state tensor an input `state{i}` and an output `next{i}`.
    """
    # tracing runs the model: fp16 convs are very slow on CPU, so trace on a GPU when there is
    # one, and on as few frames as possible (the exported axes are dynamic anyway)
    device = "cuda" if fp16 and torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if fp16 else torch.float32
    generator = load_generator(checkpoint, device=device, dtype=dtype)
    if stream is None:
        wrapper: nn.Module = _ExportWrapper(generator, fp16).eval()
        dummy: tuple[torch.Tensor, ...] = (
            torch.zeros(1, checkpoint.config.num_mels, 2, device=device),
        )
        names: dict[str, Any] = dict(
            input_names=["mel"],
            output_names=["audio"],
            dynamic_axes={"mel": {0: "batch", 2: "frames"}, "audio": {0: "batch", 1: "samples"}},
        )
    else:
        streamed = _StreamExportWrapper(generator, fp16, stream == "final")
        wrapper = streamed
        state = streamed.streamer.initial_state(1, dtype, device)
        # enough frames that every layer of the step graph produces output
        frames = checkpoint.config.receptive_field[1] + 4
        dummy = (torch.zeros(1, checkpoint.config.num_mels, frames, device=device), *state)
        inputs = [f"state{i}" for i in range(len(state))]
        outputs = [f"next{i}" for i in range(len(state))]
        names = dict(
            input_names=["mel", *inputs],
            output_names=["audio", *outputs],
            dynamic_axes={
                "mel": {0: "batch", 2: "frames"},
                "audio": {0: "batch", 1: "samples"},
                **{n: {0: "batch", 3: f"{n}_len"} for n in inputs + outputs},
            },
        )
    with _written_atomically(path) as tmp, torch.inference_mode(), warnings.catch_warnings():
        # the legacy exporter is chosen on purpose (FACTS: it gives the verified graph)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", UserWarning)  # constant folding skips dynamic slices
        torch.onnx.export(wrapper, dummy, tmp, dynamo=False, opset_version=ONNX_OPSET, **names)
    return path


@contextmanager
def _written_atomically(path: Path) -> Iterator[str]:
    """A temporary file beside `path` for the caller to write; once written it replaces `path`
    (readable by all), and on an error it is removed. Concurrent writers of one cache key write
    identical files, so the last replace wins harmlessly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=f"{path.suffix}.tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class OnnxBackend(Backend):
    """ONNX Runtime over an export cached by checkpoint and config; CUDA in fp16 when present.

    `use_cuda` / `fp16`: None picks CUDA (then fp16) when onnxruntime has its CUDA provider;
    `int8` runs the residual blocks in int8 on the CPU (`quantize.py`), calibrated on
    `calibration` (mels `[1, num_mels, frames]`, `VocoderVoice.calibration_mels`), but those of
    the last `fp32_stages` upsampling stages; each graph is quantised once and cached by
    checkpoint, calibration and stages. `intra_op_threads` 0 is ORT's default (all cores);
    `cache_dir` overrides `default_cache_dir()`. `exported` tells whether this instance wrote
    the model (False: it came from the cache).
    """

    name = "onnxruntime"

    def __init__(
        self,
        checkpoint: GeneratorCheckpoint | str | Path | None = None,
        *,
        cache_dir: str | Path | None = None,
        use_cuda: bool | None = None,
        fp16: bool | None = None,
        intra_op_threads: int = 0,
        graph_optimization: str = "all",
        allow_spinning: bool = True,
        int8: bool = False,
        calibration: Sequence[np.ndarray] | None = None,
        fp32_stages: int = FP32_STAGES,
    ):
        import onnxruntime as ort

        if not isinstance(checkpoint, GeneratorCheckpoint):
            checkpoint = resolve_checkpoint(checkpoint)
        if graph_optimization not in GRAPH_OPTIMIZATION_LEVELS:
            raise ValueError(
                f"graph_optimization must be one of {GRAPH_OPTIMIZATION_LEVELS} "
                f"(got {graph_optimization!r})"
            )
        if intra_op_threads < 0:
            raise ValueError(
                f"intra_op_threads must be >= 0, 0 meaning ORT's default (got {intra_op_threads})"
            )
        cuda_present = "CUDAExecutionProvider" in ort.get_available_providers()
        if use_cuda and not cuda_present:
            raise ValueError(
                "use_cuda=True but onnxruntime has no CUDAExecutionProvider "
                "(install onnxruntime-gpu on a CUDA host)"
            )
        if int8 and (use_cuda or fp16):
            raise ValueError("int8 runs on the CPU with fp32 activations: not with CUDA or fp16")
        if int8 and not calibration:
            raise ValueError("int8 needs calibration mels (a voice's calibration codes)")
        check_fp32_stages(checkpoint.config, fp32_stages)
        self.int8 = int8
        self.use_cuda = False if int8 else cuda_present if use_cuda is None else use_cuda
        self.fp16 = self.use_cuda if fp16 is None else fp16
        self.config = checkpoint.config
        self.checkpoint = checkpoint
        self._calibration = [np.ascontiguousarray(m, dtype=np.float32) for m in calibration or []]
        self._fp32_stages = fp32_stages
        self._quantization = ""
        if int8:
            self._quantization = calibration_key(self._calibration, fp32_stages)

        self._cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.model_path = self._export_path()
        self.exported = not self.model_path.is_file()
        self._model(None)

        opts = ort.SessionOptions()
        opts.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[graph_optimization]
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # A memory pattern is planned and kept for every input shape, and chunk sizes vary from
        # call to call: one long stream of the default voice left 450 MiB of plans behind, for
        # no measurable speed. A large process also dies slower (the kernel frees its memory
        # before it closes its sockets), so callers would learn of a crash later.
        opts.enable_mem_pattern = False
        # spinning workers cut latency on dedicated cores but steal time on shared ones
        opts.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
        )
        providers: list = ["CPUExecutionProvider"]
        if self.use_cuda:
            providers.insert(0, ("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC"}))
        self._opts, self._providers = opts, providers
        self.session = ort.InferenceSession(str(self.model_path), opts, providers=providers)
        self._stream_sessions: tuple[Any, ...] | None = None  # (step, final), built on first use
        self._initial_states: dict[int, list[np.ndarray]] = {}

    def _export_path(self, stream: str | None = None, fp32: bool = False) -> Path:
        """The cached model file of the offline graph (`stream` None) or a streaming graph
        ("step", "final"), in this backend's precision or, `fp32`, the float export."""
        precision = (
            "fp32" if fp32 else f"int8-{self._quantization}" if self.int8 else self.precision
        )
        kind = "" if stream is None else f"-stream-{stream}"
        return self._cache / (
            f"hifigan-{self.checkpoint.fingerprint[:24]}-v{_EXPORT_VERSION}"
            f"-op{ONNX_OPSET}-{precision}{kind}.onnx"
        )

    def _exported(self, stream: str | None, fp32: bool = False) -> Path:
        path = self._export_path(stream, fp32)
        if not path.is_file():
            graph = "offline graph" if stream is None else f"{stream} streaming graph"
            log.info("exporting the %s of %s to %s", graph, self.checkpoint.path, path)
            export_onnx(self.checkpoint, path, fp16=self.fp16 and not fp32, stream=stream)
        return path

    def _model(self, stream: str | None) -> Path:
        """The graph's model file in this backend's precision, exported (and for int8
        quantised) on first use."""
        if not self.int8:
            return self._exported(stream)
        path = self._export_path(stream)
        if path.is_file():
            return path
        log.info("quantising the generator of %s to int8 in %s", self.checkpoint.path, self._cache)
        if stream is None:
            feeds = [{"mel": mel} for mel in self._calibration]
            return quantize_graph(
                self._exported(None, fp32=True), path, feeds, self.config, self._fp32_stages
            )
        import onnxruntime as ort

        fp32 = {kind: self._exported(kind, fp32=True) for kind in ("step", "final")}
        # every core for the calibration runs: the service is not serving yet
        options = ort.SessionOptions()
        options.enable_mem_pattern = False
        step = ort.InferenceSession(str(fp32["step"]), options, providers=self._providers)
        state = [t.numpy() for t in initial_state(self.config, 1, torch.float32)]
        lag = self.receptive_field[1]
        calls = dict(zip(("step", "final"), stream_feeds(step, self._calibration, state, lag)))
        for kind in ("step", "final"):
            quantize_graph(
                fp32[kind], self._export_path(kind), calls[kind], self.config, self._fp32_stages
            )
        return path

    def _streaming_sessions(self):
        import onnxruntime as ort

        if self._stream_sessions is None:
            sessions = [
                ort.InferenceSession(str(self._model(kind)), self._opts, providers=self._providers)
                for kind in ("step", "final")
            ]
            self._state_names = [i.name for i in sessions[0].get_inputs()][1:]
            self._stream_sessions = tuple(sessions)
        return self._stream_sessions

    def _initial_state(self, batch: int) -> list[np.ndarray]:
        """A fresh state for `batch` streams (shared: ONNX Runtime only reads its inputs)."""
        if batch not in self._initial_states:
            dtype = torch.float16 if self.fp16 else torch.float32
            self._initial_states[batch] = [
                t.numpy() for t in initial_state(self.config, batch, dtype)
            ]
        return self._initial_states[batch]

    def _run_streamed(self, mel, state: list[np.ndarray], final: bool) -> list[np.ndarray]:
        if isinstance(mel, torch.Tensor):
            mel = mel.detach().cpu().numpy()
        step, last = self._streaming_sessions()
        feed = dict(zip(self._state_names, state))
        feed["mel"] = np.ascontiguousarray(mel, dtype=np.float32)
        return (last if final else step).run(None, feed)

    def run_stream(self, mel, state, final=False):
        if mel.ndim != 3 or mel.shape[:2] != (1, self.num_mels):
            raise ValueError(f"mel must be [1, {self.num_mels}, frames] (got {tuple(mel.shape)})")
        audio, *state = self._run_streamed(
            mel, self._initial_state(1) if state is None else state, final
        )
        return audio[0], state

    def run_streams(self, mel, states, final=False):
        """One ONNX Runtime call for all the streams, their states stacked along the batch as
        `TorchBackend.run_streams` stacks them, so that a call's fixed cost is paid once."""
        self._check_streams(mel, states)
        batch = len(states)
        if states[0] is None:
            stacked = self._initial_state(batch)  # its length-only markers have a batch of 1
        else:
            stacked = [np.concatenate(parts) for parts in zip(*cast(list[list], states))]
        audio, *state = self._run_streamed(mel, stacked, final)
        rows = [np.split(t, batch) if t.shape[0] == batch else [t] * batch for t in state]
        return list(audio), [list(parts) for parts in zip(*rows)]

    @property
    def device(self) -> str:
        return self.session.get_providers()[0]

    @property
    def precision(self) -> str:
        return "int8" if self.int8 else "fp16" if self.fp16 else "fp32"

    def run(self, mel: np.ndarray | torch.Tensor) -> np.ndarray:
        self._check(mel)
        if isinstance(mel, torch.Tensor):
            mel = mel.detach().cpu().numpy()
        x = np.ascontiguousarray(mel, dtype=np.float32)
        return self.session.run(["audio"], {"mel": x})[0]


BACKEND_KINDS = ("onnxruntime", "torch")


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tile units, which oneDNN runs bf16 convolutions on."""
    return bool(torch.cpu._is_amx_tile_supported())


def cpu_vendor() -> str:
    """The CPU's vendor string as Linux reports it ("GenuineIntel", "AuthenticAMD"), or ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_runs_bf16_convs_fast() -> bool:
    """Whether oneDNN's bf16 convolutions beat ONNX Runtime's fp32 ones on this CPU, streamed:
    where it has AMX tiles, or AVX-512 BF16 on an AMD CPU (Zen 4 on), whose `vdpbf16ps` runs
    at twice its fp32 multiply-add rate. Intel's cores without AMX run that instruction at a
    quarter of theirs, and there bf16 lost to ONNX Runtime fp32 (bench/README.md)."""
    if cpu_has_amx():
        return True
    return cpu_vendor() == "AuthenticAMD" and bool(torch.cpu._is_avx512_bf16_supported())


def cpu_has_avx2_alone() -> bool:
    """Whether this CPU's widest vectors are AVX2's (torch picked its AVX2 kernels): no AVX-512,
    as on an AMD EPYC before Zen 4."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def cpu_runs_int8_convs_fast() -> bool:
    """Whether int8 convolutions (`quantize.py`) make this CPU's fastest generator, on a CPU
    without AMX (whose bf16 tiles the torch generator uses instead):
    - with AVX-512 VNNI, whose `vpdpbusd` does four times the multiply-adds of an fp32 FMA;
    - with AVX2 alone, where ONNX Runtime multiplies bytes with `vpmaddubsw`: on an AMD EPYC
      (Zen 3) its int8 took 0.46 CPU s per audio s streamed against fp32's 0.68, with the
      default voice's WER 0.65 points and DNSMOS 0.03 from fp32's on the natural held-out set.
      The split deployment served one stream at RTF 0.49-0.51 with no chunk late after a
      150 ms buffer, where fp32 ran at 0.75-0.77 with 7 late, and made 1.4x the audio at 4
      streams (bench/README.md).
    Intel's AVX-512 CPUs without VNNI (Skylake) are not measured and keep fp32."""
    if cpu_has_amx():
        return False
    return bool(torch.cpu._is_vnni_supported()) or cpu_has_avx2_alone()


def int8_runtime() -> str:
    """Which runtime runs the int8 generator on this CPU: torch, on oneDNN's int8 convolutions
    with the rest of the generator in bf16, where those bf16 convolutions are fast
    (`cpu_runs_bf16_convs_fast`); else ONNX Runtime, the rest in fp32. On an AMD EPYC (Zen 4)
    torch's took 0.177 CPU s per audio s streamed against ONNX Runtime's 0.246, with DNSMOS
    nearer fp32's, and the deployment made 1.36-1.39x the audio at 8 streams (bench/README.md)."""
    return "torch" if cpu_runs_bf16_convs_fast() else "onnx"


def auto_backend(device: torch.device, int8_calibrated: bool = False) -> tuple[str, str]:
    """(backend, precision) of the vocoder when the operator names neither: the one place that
    default is decided. On a CPU:

    - int8 where `cpu_runs_int8_convs_fast` (AVX-512 VNNI, or AVX2 alone, and no AMX) and the
      voices bring their int8 calibration (`int8_calibrated`), on `int8_runtime`. On an AMD
      EPYC (Zen 4) ONNX Runtime's int8 took 0.244 CPU s per audio s streamed, against 0.270
      for bf16 and 0.532 for fp32, and the split deployment made 12-22% more audio at 8
      streams than with bf16, with the default voice's WER within 0.4 points and DNSMOS within
      0.03 of fp32 on the natural held-out set; torch's int8 is cheaper still there; on a Zen 3
      ONNX Runtime's took 0.67x fp32's time (bench/README.md). On Intel CPUs with VNNI and no AMX it
      replaces ONNX Runtime fp32 on the same kernels' library, by the instruction rates; not
      measured on one yet.
    - torch in bf16 where oneDNN's bf16 convolutions are fast (`cpu_runs_bf16_convs_fast`):
      about half of ONNX Runtime fp32's CPU time streamed, with WER within 0.5 points and
      DNSMOS within 0.01 of it, measured on an Intel Xeon with AMX and on an AMD EPYC. On an
      Intel CPU with AVX-512 BF16 alone the same bf16 convolutions ran slower than ONNX
      Runtime's fp32 (0.62-0.78 against 0.40 CPU s per audio s).
    - else ONNX Runtime fp32.

    An NPU runs torch in fp16; CUDA runs ONNX Runtime in fp16."""
    if device.type == "cpu":
        if int8_calibrated and cpu_runs_int8_convs_fast():
            return int8_runtime(), "int8"
        return ("torch", "bf16") if cpu_runs_bf16_convs_fast() else ("onnx", "fp32")
    if device.type == "npu":
        return "torch", "fp16"
    return "onnx", "fp16"


def create_backend(
    kind: str = "onnxruntime",
    checkpoint: GeneratorCheckpoint | str | Path | None = None,
    *,
    device: str = "auto",
    fp16: bool | None = None,
    intra_op_threads: int = 0,
    cache_dir: str | Path | None = None,
) -> Backend:
    """Backend by name. device: 'auto', 'cpu', 'cuda[:i]', 'npu' (torch only); fp16 None = on GPUs."""
    if kind in ("onnxruntime", "onnx", "ort"):
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"the onnxruntime backend runs on 'cpu' or 'cuda' (got {device!r})")
        use_cuda = None if device == "auto" else device == "cuda"
        return OnnxBackend(
            checkpoint,
            cache_dir=cache_dir,
            use_cuda=use_cuda,
            fp16=fp16,
            intra_op_threads=intra_op_threads,
        )
    if kind == "torch":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        on_gpu = not device.startswith("cpu")
        return TorchBackend(checkpoint, device=device, fp16=on_gpu if fp16 is None else fp16)
    raise ValueError(f"backend must be one of {BACKEND_KINDS} (got {kind!r})")
