"""The generator in int8 (`vocoder_service/quantize.py`): which convolutions stay fp32, the
quantised offline and streaming graphs against fp32, their cache, torch's int8 generator on
oneDNN (its layers, its audio, its cached ranges), the voice's calibration codes, and the
service run with `--int8` on both runtimes."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file

from kernels import onednn_conv
from tests.test_backends import STACK_STEPS, _stacked_against_alone
from tests.test_hifigan import V1_FEWER_BLOCKS, V1_TINY
from tests.test_vocoder_service import info_and_audio, snr_db, vocoder_process
from tests.voices import make_random_voice
from vocoder_service import quantize
from vocoder_service.backends import (
    OnnxBackend,
    TorchBackend,
    auto_backend,
    cpu_runs_int8_convs_fast,
    export_onnx,
)
from vocoder_service.checkpoint import resolve_checkpoint
from vocoder_service.client import token_requests
from vocoder_service.hifigan import Generator, HifiGanConfig
from vocoder_service.quantize import fp32_nodes, int8_blocks, quantize_graph
from vocoder_service.voice import CALIBRATION_NAME, load_voice

TINY = HifiGanConfig.from_dict(V1_TINY)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random generator of V1's shape at small width, as a checkpoint folder."""
    torch.manual_seed(0)
    g = Generator(TINY).remove_weight_norm()
    folder = tmp_path_factory.mktemp("tiny")
    save_file(
        {k: v.contiguous() for k, v in g.state_dict().items()},
        str(folder / "generator.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(TINY.to_dict()))
    return resolve_checkpoint(folder)


def mels(count: int, frames: int, seed: int) -> list[np.ndarray]:
    """Log-mel-like noise `[1, 80, frames]` (speech sits around -6 .. 0)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((1, 80, frames)) - 5).astype(np.float32) for _ in range(count)]


def weight_dequantized(path) -> dict[str, bool]:
    """Conv node -> whether its weight comes through a DequantizeLinear."""
    model = onnx.load(str(path))
    producers = {o: n for n in model.graph.node for o in n.output}
    return {
        n.name: producers.get(n.input[1]) is not None
        and producers[n.input[1]].op_type == "DequantizeLinear"
        for n in model.graph.node
        if n.op_type in ("Conv", "ConvTranspose")
    }


def streamed(backend, mel: np.ndarray, sizes=(3, 7, 20, 100)) -> np.ndarray:
    """`mel` through `run_stream`: the first call just long enough, then `sizes` frames a call."""
    state, pieces, start = None, [], 0
    for n in (backend.receptive_field[1] + 1, *sizes):
        part = mel[:, :, start : start + n]
        start += n
        audio, state = backend.run_stream(part, state, final=start >= mel.shape[-1])
        pieces.append(audio)
        if start >= mel.shape[-1]:
            break
    return np.concatenate(pieces)


def test_only_the_early_stages_residual_blocks_run_in_int8(tiny, tmp_path):
    model = onnx.load(str(export_onnx(tiny, tmp_path / "fp32.onnx")))
    convs = [n.name for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    int8 = [n for n in convs if n not in fp32_nodes(model, TINY, 1)]
    # 3 stages of 3 blocks of 3 units of 2 convs; conv_pre, upsamplers and conv_post fp32
    assert len(int8) == 3 * 3 * 3 * 2
    assert all(int(n.split("resblocks.")[1].split("/")[0]) < 9 for n in int8)
    assert convs[0] not in int8 and convs[-1] not in int8
    assert not [n for n in int8 if "ConvTranspose" in n]
    assert len(convs) - len(fp32_nodes(model, TINY, 0)) == 4 * 3 * 3 * 2
    assert fp32_nodes(model, TINY, 4) == convs
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=r"fp32_stages must be in \[0, 4\]"):
            fp32_nodes(model, TINY, bad)


def test_quantised_offline_graph_runs_close_to_fp32(tiny, tmp_path):
    src = export_onnx(tiny, tmp_path / "fp32.onnx")
    out = quantize_graph(src, tmp_path / "int8.onnx", [{"mel": m} for m in mels(4, 40, 0)], TINY)
    keep = set(fp32_nodes(onnx.load(str(src)), TINY, 1))
    quantised = weight_dequantized(out)
    assert quantised and all(v == (k not in keep) for k, v in quantised.items())
    mel = mels(1, 30, 1)[0]

    def run(path):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {"mel": mel})[0]

    want, got = run(src), run(out)
    assert got.shape == want.shape == (1, 30 * 256)
    assert snr_db(want, got) > 25  # 41 dB here; a broken graph gives noise near 0 dB


def test_int8_backend_streams_close_to_fp32_from_cached_graphs(tiny, tmp_path):
    calibration = mels(4, 60, 0)
    int8 = OnnxBackend(
        tiny, int8=True, calibration=calibration, cache_dir=tmp_path, intra_op_threads=1
    )
    fp32 = OnnxBackend(tiny, cache_dir=tmp_path, intra_op_threads=1)
    assert (int8.precision, fp32.precision) == ("int8", "fp32") and int8.exported
    mel = mels(1, 50, 2)[0]
    want = fp32.run(mel)[0]
    got = streamed(int8, mel)
    assert len(got) == len(want) == 50 * 256
    assert snr_db(want, got) > 25  # 41 dB
    assert snr_db(want, int8.run(mel)[0]) > 25
    # the step and final graphs quantise every convolution but the last stage's and conv_post
    graphs = sorted(p for p in os.listdir(tmp_path) if "-int8-" in p)
    assert len(graphs) == 3 and {g.split("-")[-1] for g in graphs} == {
        f"{int8._quantization}.onnx",
        "step.onnx",
        "final.onnx",
    }
    for name in graphs:
        quantised = weight_dequantized(tmp_path / name)
        assert (
            0
            < sum(quantised.values())
            == len(quantised) - len(fp32_nodes(onnx.load(str(tmp_path / name)), TINY, 1))
        )
    # the same calibration finds its graphs in the cache; another calibration has its own
    mtimes = {g: os.stat(tmp_path / g).st_mtime_ns for g in graphs}
    again = OnnxBackend(tiny, int8=True, calibration=calibration, cache_dir=tmp_path)
    assert not again.exported and np.array_equal(streamed(again, mel), got)
    assert {g: os.stat(tmp_path / g).st_mtime_ns for g in graphs} == mtimes
    # streams stacked in one call of the int8 graphs get what each would alone
    together, alone = _stacked_against_alone(int8, mels(3, 38, 5), STACK_STEPS)
    for t, a in zip(together, alone):
        np.testing.assert_allclose(t, a, atol=1e-5, rtol=0)
    other = OnnxBackend(tiny, int8=True, calibration=mels(2, 60, 9), cache_dir=tmp_path)
    assert other.exported and other.model_path.name not in graphs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(int8=True), "int8 needs calibration mels"),
        (dict(int8=True, calibration=[], fp16=True), "int8 runs on the CPU"),
        (dict(int8=True, calibration=[np.zeros((1, 80, 8))], fp32_stages=9), "fp32_stages"),
    ],
)
def test_int8_backend_refuses_what_it_cannot_run(tiny, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        OnnxBackend(tiny, cache_dir=tmp_path, **kwargs)
    assert not list(tmp_path.glob("*int8*"))


needs_onednn_int8 = pytest.mark.skipif(
    not (onednn_conv.int8_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="torch's int8 generator needs oneDNN's int8 convolutions and bf16",
)


@needs_onednn_int8
def test_torch_int8_runs_the_early_residual_blocks_on_onednn_int8(tiny, tmp_path):
    backend = TorchBackend(
        tiny, bf16=True, int8=True, calibration=mels(3, 60, 0), cache_dir=tmp_path
    )
    assert backend.precision == "int8"
    g = backend.generator
    blocks = int8_blocks(TINY, 1)
    assert 0 < blocks < len(g.resblocks)
    for i, block in enumerate(g.resblocks):
        for conv in (m for m in block.modules() if isinstance(m, torch.nn.Conv1d)):
            packed = conv.packed_weight
            assert isinstance(packed, onednn_conv.QuantizedConv) == (i < blocks)
            assert isinstance(packed, onednn_conv.PackedConv) == (i >= blocks)
            if i < blocks:  # the grid spans what calibration saw, 0 included
                assert packed.scale > 0 and 0 < packed.zero_point < 255
    for edge in (g.conv_pre, g.conv_post, *g.ups):
        assert not isinstance(edge.packed_weight, onednn_conv.QuantizedConv)


@needs_onednn_int8
def test_torch_int8_streams_close_to_fp32_and_caches_its_ranges(tiny, tmp_path, monkeypatch):
    calibration = mels(4, 60, 0)
    int8 = TorchBackend(tiny, bf16=True, int8=True, calibration=calibration, cache_dir=tmp_path)
    mel = mels(1, 50, 2)[0]
    want = TorchBackend(tiny).run(mel)[0]
    got = streamed(int8, mel)
    assert len(got) == len(want) == 50 * 256
    assert snr_db(want, got) > 25  # 31 dB here; a broken conv gives noise near 0 dB
    assert snr_db(int8.run(mel)[0], got) > 40  # offline synthesis, up to bf16's rounding
    together, alone = _stacked_against_alone(int8, mels(3, 38, 5), STACK_STEPS)
    for t, a in zip(together, alone):
        assert snr_db(a, t) > 40
    # the ranges are cached by checkpoint and calibration: a second backend measures nothing
    (cached,) = tmp_path.glob("*-torch-int8-*.json")
    assert sorted(json.loads(cached.read_text())) == sorted(
        f"resblocks.{i}.{name}"
        for i, block in enumerate(int8.generator.resblocks[: int8_blocks(TINY, 1)])
        for name, m in block.named_modules()
        if isinstance(m, torch.nn.Conv1d)
    )

    def no_calibration(*args):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(quantize, "calibration_calls", no_calibration)
    again = TorchBackend(tiny, bf16=True, int8=True, calibration=calibration, cache_dir=tmp_path)
    np.testing.assert_array_equal(streamed(again, mel), got)
    with pytest.raises(AssertionError, match="calibrated again"):
        TorchBackend(tiny, bf16=True, int8=True, calibration=mels(2, 60, 9), cache_dir=tmp_path)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(int8=True, calibration=[np.zeros((1, 80, 8))]), "the rest of the generator in bf16"),
        (dict(int8=True, bf16=True), "int8 needs calibration mels"),
        (dict(int8=True, bf16=True, calibration=[np.zeros((1, 80, 8))], fp32_stages=9), "fp32_"),
    ],
)
def test_torch_int8_refuses_what_it_cannot_run(tiny, tmp_path, kwargs, match):
    if "fp32_stages" in kwargs and not onednn_conv.int8_available():
        pytest.skip("no oneDNN int8 convolutions here")
    with pytest.raises(ValueError, match=match):
        TorchBackend(tiny, cache_dir=tmp_path, **kwargs)
    assert not list(tmp_path.glob("*int8*"))


def test_torch_refuses_bf16_and_int8_where_onednn_cannot_run_them(tiny, tmp_path, monkeypatch):
    """A CPU with AVX2 alone (an AMD Zen 3): oneDNN refuses to pack bf16 weights at all, and its
    u8s8 convolutions saturate without VNNI. The backend says so at start, naming the
    instruction sets, instead of failing inside oneDNN or computing wrong audio."""
    calibration = [np.zeros((1, 80, 8))]
    monkeypatch.setattr(onednn_conv, "onednn_bf16_available", lambda: False)
    assert not onednn_conv.packing_available(torch.bfloat16)
    assert onednn_conv.packing_available(torch.float32) == onednn_conv.packing_available()
    for kwargs in (dict(bf16=True), dict(bf16=True, int8=True, calibration=calibration)):
        with pytest.raises(ValueError, match="needs oneDNN's bf16 convolutions .*AVX-512 BF16"):
            TorchBackend(tiny, cache_dir=tmp_path, **kwargs)
    TorchBackend(tiny, cache_dir=tmp_path)  # fp32 runs anywhere
    monkeypatch.setattr(onednn_conv, "onednn_bf16_available", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert not onednn_conv.int8_available()
    with pytest.raises(ValueError, match="int8 on torch needs .*AVX-512 VNNI"):
        TorchBackend(tiny, cache_dir=tmp_path, bf16=True, int8=True, calibration=calibration)
    assert not list(tmp_path.glob("*int8*"))


def write_calibration(voice_dir, codes: list[list[int]]) -> None:
    np.savez(
        voice_dir / "vocoder" / CALIBRATION_NAME,
        codes=np.concatenate(codes).astype(np.int16),
        lengths=np.array([len(c) for c in codes], dtype=np.int32),
    )


def test_voice_calibration_codes_decode_to_mels(tmp_path):
    voice_dir = make_random_voice(tmp_path)
    voice = load_voice(voice_dir)
    with pytest.raises(ValueError, match=f"has no int8 calibration.*vocoder/{CALIBRATION_NAME}"):
        voice.calibration_mels()
    write_calibration(voice_dir, [[1, 2, 3], [4, 5, 6, 7, 8]])
    got = load_voice(voice_dir).calibration_mels()
    assert [m.shape for m in got] == [(1, 80, 6), (1, 80, 10)]
    assert got[0].dtype == np.float32
    np.testing.assert_array_equal(got[1][0], voice.token_decoder.decode(np.arange(4, 9)))
    np.savez(
        voice_dir / "vocoder" / CALIBRATION_NAME,
        codes=np.arange(5, dtype=np.int16),
        lengths=np.array([2, 2], dtype=np.int32),
    )
    with pytest.raises(ValueError, match="lengths` must be positive and add up to len"):
        load_voice(voice_dir).calibration_mels()


@pytest.mark.parametrize(
    "runtime",
    ["onnx", pytest.param("torch", marks=needs_onednn_int8)],
)
def test_service_runs_int8_on_the_voice_calibration(tmp_path, runtime):
    """`--int8`: the real pretrained V1 quantised on the voice's codes, a token stream vocoded
    through the int8 streaming generator of either runtime, close to the fp32 offline audio."""
    voice_dir = make_random_voice(tmp_path / "voices")
    rng = np.random.default_rng(0)
    write_calibration(voice_dir, [list(rng.integers(0, 64, 40)) for _ in range(3)])
    codes = rng.integers(0, 64, 60)
    info, result = info_and_audio(
        vocoder_process(
            voice_dir, tmp_path / "cache", "--int8", "--backend", runtime, "--max-streams", "2"
        ),
        token_requests(codes, 7),
    )
    assert (info.backend, info.precision) == (
        "onnxruntime" if runtime == "onnx" else runtime,
        "int8",
    )
    # with no flags the service picks int8 for a calibrated voice where the CPU runs it fast
    # (what it needs comes from the cache the first process wrote)
    auto, _ = info_and_audio(vocoder_process(voice_dir, tmp_path / "cache"))
    kind, precision = auto_backend(torch.device("cpu"), int8_calibrated=True)
    assert (auto.backend, auto.precision) == (
        "onnxruntime" if kind == "onnx" else kind,
        precision,
    )
    assert (auto.precision == "int8") == cpu_runs_int8_convs_fast()
    voice = load_voice(voice_dir)
    mel = voice.token_decoder.decode(codes)[None]
    want = OnnxBackend(voice.generator, cache_dir=tmp_path / "fp32").run(mel)[0]
    assert len(result.audio) == len(want)
    # int8 V1 held the default voice's WER and DNSMOS (bench/README.md); random codes through
    # random decoders are no speech, so here only: clearly the same signal, not noise
    assert snr_db(want, result.audio) > 5


def test_int8_flag_needs_the_cpu_and_a_calibrated_voice(tmp_path):
    import subprocess
    import sys

    from tests.procs import ROOT

    voice_dir = make_random_voice(tmp_path)
    missing = f"has no int8 calibration: it needs a token decoder and vocoder/{CALIBRATION_NAME}"
    for flags, match in (
        (("--int8",), missing),
        (("--int8", "--backend", "torch"), missing),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "vocoder_service", "--voice", str(voice_dir), "--port", "0",
             "--metrics-port", "-1", *flags],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
            env={**os.environ, "SPLITTTS_CACHE": str(tmp_path / "cache")},
        )  # fmt: skip
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and match in lines[0], (flags, r.stderr)
        assert "Error" not in lines[0].split(":")[0]


def test_int8_blocks_count_each_stages_own_blocks():
    fewer = HifiGanConfig.from_dict(V1_FEWER_BLOCKS)  # 1, 2, 3 and 2 blocks a stage
    assert [int8_blocks(fewer, keep) for keep in (4, 3, 2, 1, 0)] == [0, 1, 3, 6, 8]
    assert int8_blocks(TINY, 1) == 9


def test_a_generator_with_fewer_blocks_streams_in_onnx_runtime_fp32_and_int8(tmp_path):
    """Stages of 1, 2, 3 and 2 blocks: the exported streaming graphs equal torch offline in
    fp32, and int8 quantises the first three stages' 6 blocks and tracks fp32."""
    config = HifiGanConfig.from_dict(V1_FEWER_BLOCKS)
    torch.manual_seed(1)
    g = Generator(config).remove_weight_norm()
    folder = tmp_path / "fewer"
    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in g.state_dict().items()},
        str(folder / "generator.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    checkpoint = resolve_checkpoint(folder)
    mel = mels(1, 50, 4)[0]
    want = TorchBackend(checkpoint).run(mel)[0]
    cache = tmp_path / "cache"
    fp32 = OnnxBackend(checkpoint, cache_dir=cache, intra_op_threads=1)
    assert np.abs(streamed(fp32, mel) - want).max() <= 1e-4
    int8 = OnnxBackend(
        checkpoint, int8=True, calibration=mels(3, 60, 0), cache_dir=cache, intra_op_threads=1
    )
    assert snr_db(want, streamed(int8, mel)) > 25
    (step,) = cache.glob("*-int8-*step.onnx")
    quantised = weight_dequantized(step)
    assert sum(quantised.values()) == 6 * 6  # six blocks of six convolutions each
