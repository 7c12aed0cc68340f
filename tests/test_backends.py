"""Torch and ONNX Runtime backends: agreement, export cache, batching."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vocoder_service.backends import OnnxBackend, TorchBackend, create_backend, default_cache_dir
from vocoder_service.checkpoint import pretrained_checkpoint, resolve_checkpoint
from vocoder_service.hifigan import Generator, HifiGanConfig

TINY = dict(
    resblock="2",
    upsample_rates=[8, 8, 4],
    upsample_kernel_sizes=[16, 16, 8],
    upsample_initial_channel=32,
    resblock_kernel_sizes=[3, 5, 7],
    resblock_dilation_sizes=[[1, 2], [2, 6], [3, 12]],
)


@pytest.fixture(scope="session")
def onnx_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="session")
def ort_backend(onnx_cache) -> OnnxBackend:
    return OnnxBackend(cache_dir=onnx_cache, intra_op_threads=1)  # the machine is shared


@pytest.fixture(scope="module")
def torch_backend() -> TorchBackend:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: two busy OpenMP threads run slower than one
    yield TorchBackend()
    torch.set_num_threads(before)


def _mel(batch: int, frames: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # smooth in time like real log-mel, around speech levels
    noise = rng.normal(0, 1.5, (batch, 80, frames + 2))
    return (noise[..., :-2] + noise[..., 1:-1] + noise[..., 2:]) / 3 - 5.0


def test_ort_matches_torch(ort_backend, torch_backend):
    mel = _mel(2, 40).astype(np.float32)
    a, b = ort_backend.run(mel), torch_backend.run(mel)
    assert a.shape == b.shape == (2, 40 * 256) and a.dtype == b.dtype == np.float32
    assert np.abs(a - b).max() <= 1e-3
    assert np.abs(a).max() > 1e-3  # not trivially silent
    assert ort_backend.exported and ort_backend.device == "CPUExecutionProvider"


def test_export_is_cached_by_checkpoint(ort_backend, onnx_cache):
    mtime = ort_backend.model_path.stat().st_mtime_ns
    again = OnnxBackend(cache_dir=onnx_cache, intra_op_threads=1)
    assert not again.exported and again.model_path == ort_backend.model_path
    assert again.model_path.stat().st_mtime_ns == mtime
    mel = _mel(1, 9, seed=3).astype(np.float32)
    np.testing.assert_array_equal(again.run(mel), ort_backend.run(mel))
    other = OnnxBackend(pretrained_checkpoint("LJSpeech"), cache_dir=onnx_cache)
    assert other.exported and other.model_path != ort_backend.model_path
    assert sorted(p.name for p in onnx_cache.iterdir()) == sorted(
        [ort_backend.model_path.name, other.model_path.name]
    )


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITTTS_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "onnx"
    monkeypatch.delenv("SPLITTTS_CACHE")
    assert str(default_cache_dir()).endswith(".cache/split-tts/onnx")


@pytest.mark.parametrize("which", ["ort", "torch"])
def test_batched_equals_unbatched(which, ort_backend, torch_backend):
    backend = ort_backend if which == "ort" else torch_backend
    mel = _mel(3, 17, seed=1).astype(np.float32)
    batched = backend.run(torch.from_numpy(mel) if which == "torch" else mel)
    for i in range(3):
        np.testing.assert_allclose(batched[i], backend.run(mel[i : i + 1])[0], atol=1e-5, rtol=0)


def test_bad_input_shape_raises(ort_backend, torch_backend):
    for backend in (ort_backend, torch_backend):
        with pytest.raises(ValueError, match="mel must be"):
            backend.run(np.zeros((1, 79, 10), np.float32))
        with pytest.raises(ValueError, match="mel must be"):
            backend.run(np.zeros((80, 10), np.float32))


def test_fp16_paths_track_fp32(tmp_path):
    torch.manual_seed(0)
    generator = Generator(HifiGanConfig.from_dict(TINY))
    torch.save({"generator": generator.state_dict()}, tmp_path / "g_00000001")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    ckpt = resolve_checkpoint(tmp_path)
    mel = _mel(1, 6, seed=2).astype(np.float32)
    ref = TorchBackend(ckpt).run(mel)
    half = TorchBackend(ckpt, fp16=True)
    assert half.dtype == torch.float16
    np.testing.assert_allclose(half.run(mel), ref, atol=2e-2, rtol=0)
    ort16 = OnnxBackend(ckpt, cache_dir=tmp_path / "cache", fp16=True, use_cuda=False)
    assert ort16.model_path.name.endswith("-fp16.onnx")
    out = ort16.run(mel)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=2e-2, rtol=0)


def test_create_backend(onnx_cache, ort_backend):
    assert isinstance(create_backend("torch", device="cpu"), TorchBackend)
    backend = create_backend("onnxruntime", device="cpu", cache_dir=onnx_cache)
    assert isinstance(backend, OnnxBackend) and not backend.exported and not backend.fp16
    with pytest.raises(ValueError, match="backend must be"):
        create_backend("tensorrt")
    with pytest.raises(ValueError, match="no CUDAExecutionProvider"):
        OnnxBackend(cache_dir=onnx_cache, use_cuda=True)


@pytest.mark.parametrize("which", ["ort", "torch"])
def test_stateful_streaming_equals_offline(which, ort_backend, torch_backend, onnx_cache):
    """The exported step and final graphs carry the state as inputs and outputs; chunks of any
    size (0 frames at the end too) give the offline audio."""
    backend = ort_backend if which == "ort" else torch_backend
    mel = _mel(1, 70, seed=5).astype(np.float32)
    offline = backend.run(mel)[0]
    state, pieces, start = None, [], 0
    for n, final in [(14, False), (1, False), (40, False), (15, False), (0, True)]:
        audio, state = backend.run_stream(mel[:, :, start : start + n], state, final)
        pieces.append(audio)
        start += n
    streamed = np.concatenate(pieces)
    assert streamed.shape == offline.shape and streamed.dtype == np.float32
    assert np.abs(streamed - offline).max() <= 1e-4
    if which == "ort":
        names = sorted(p.name for p in onnx_cache.iterdir() if "stream" in p.name)
        assert len(names) == 2 and names[0].endswith("-stream-final.onnx")


def reference_mel(frames: int = 40) -> np.ndarray:
    """A fixed log-mel `[1, 80, frames]` from closed-form sinusoids (no random number stream
    that a library update could change)."""
    m, t = np.arange(80)[:, None], np.arange(frames)[None, :]
    mel = (
        -3.5 + 1.8 * np.sin(0.21 * m + 0.47 * t) + 1.1 * np.cos(0.037 * m * t + 0.3 * t) - 0.02 * m
    )
    return mel.astype(np.float32)[None]


def test_one_generator_definition_gives_the_same_audio_in_all_three_forms(
    ort_backend, torch_backend
):
    """Offline torch, stateful streaming chunk by chunk (torch, and the exported step and final
    graphs in ONNX Runtime) and the offline ONNX export all derive from `Generator.forward`; each
    gives the audio recorded from the pretrained generator before they did (commit f20b853,
    when the three were written separately)."""
    recorded = np.load(Path(__file__).parent / "fixtures" / "hifigan_universal_f20b853.npz")[
        "audio"
    ]
    mel = reference_mel()
    forms = {"torch offline": torch_backend.run(mel)[0], "onnx offline": ort_backend.run(mel)[0]}
    for name, backend in (("torch", torch_backend), ("onnx", ort_backend)):
        state, pieces, start = None, [], 0
        for n, final in [(15, False), (1, False), (17, False), (7, True)]:
            audio, state = backend.run_stream(mel[:, :, start : start + n], state, final)
            pieces.append(audio)
            start += n
        forms[f"{name} streamed"] = np.concatenate(pieces)
    assert np.abs(recorded).max() > 0.1  # not silence
    for name, audio in forms.items():
        assert audio.shape == recorded.shape, name
        assert np.abs(audio - recorded).max() <= 1e-4, name


def test_exports_run_height_one_2d_convolutions(ort_backend):
    """ONNX Runtime's CPU provider only takes 4-D convs into its fast blocked layout: every conv
    of both exported forms is 2-D with a kernel of height 1, its weights folded to constants."""
    import onnx

    ort_backend.run_stream(np.zeros((1, 80, 20), np.float32), None)  # exports the stream graphs
    for path in (ort_backend.model_path, ort_backend._export_path("step")):
        graph = onnx.load(str(path)).graph
        convs = [n for n in graph.node if n.op_type in ("Conv", "ConvTranspose")]
        assert len(convs) == 1 + 4 + 4 * 3 * 6 + 1  # pre, ups, resblocks' convs, post
        constants = {i.name for i in graph.initializer}
        for node in convs:
            kernel = next(a.ints for a in node.attribute if a.name == "kernel_shape")
            assert len(kernel) == 2 and kernel[0] == 1, node.name
            assert node.input[1] in constants, node.name


def test_sessions_keep_no_memory_plan_per_input_shape(ort_backend):
    mel = np.zeros((1, ort_backend.num_mels, 17), np.float32)
    ort_backend.run_stream(mel, None)  # builds the streaming sessions
    sessions = [ort_backend.session, *ort_backend._streaming_sessions()]
    assert [s.get_session_options().enable_mem_pattern for s in sessions] == [False] * 3


def test_stream_rejects_bad_shapes(ort_backend):
    with pytest.raises(ValueError, match=r"\[1, 80, frames\]"):
        ort_backend.run_stream(np.zeros((2, 80, 20), np.float32), None)


def _snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((out - ref) ** 2), 1e-30)))


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 on this CPU"
)
def test_bf16_on_the_cpu_tracks_fp32_offline_and_streamed():
    """bf16 runs the height-1 2-D form on weights packed once for oneDNN; offline and chunk by
    chunk streaming give the fp32 audio to within bf16's rounding."""
    recorded = np.load(Path(__file__).parent / "fixtures" / "hifigan_universal_f20b853.npz")[
        "audio"
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = TorchBackend(bf16=True)
        assert backend.dtype == torch.bfloat16
        conv = backend.generator.conv_pre
        assert conv.weight.dtype == torch.bfloat16 and conv.packed_weight.is_mkldnn
        mel = reference_mel()
        offline = backend.run(mel)[0]
        state, pieces, start = None, [], 0
        for n, final in [(15, False), (1, False), (17, False), (7, True)]:
            audio, state = backend.run_stream(mel[:, :, start : start + n], state, final)
            pieces.append(audio)
            start += n
        streamed = np.concatenate(pieces)
    finally:
        torch.set_num_threads(before)
    assert offline.shape == streamed.shape == recorded.shape
    assert offline.dtype == streamed.dtype == np.float32
    # 26 dB on this synthetic mel, 37 dB on the default voice's (bench/README.md); a wrong
    # layout or state gives noise near 0 dB
    assert _snr_db(recorded, offline) > 20, _snr_db(recorded, offline)
    assert _snr_db(recorded, streamed) > 20, _snr_db(recorded, streamed)
    assert _snr_db(offline, streamed) > 30, _snr_db(offline, streamed)
    with pytest.raises(ValueError, match="one of fp16 and bf16"):
        TorchBackend(fp16=True, bf16=True)


def _stacked_against_alone(backend, mels: list[np.ndarray], steps: list[tuple[int, bool]]):
    """Run streams through `run_streams` together and through `run_stream` one by one, chunk by
    chunk; returns (together, alone): each stream's audio."""
    together = [[] for _ in mels]
    alone = [[] for _ in mels]
    states, own = [None] * len(mels), [None] * len(mels)
    start = 0
    for n, final in steps:
        batch = np.concatenate([m[:, :, start : start + n] for m in mels])
        audio, states = backend.run_streams(batch, states, final)
        for i, m in enumerate(mels):
            together[i].append(audio[i])
            a, own[i] = backend.run_stream(m[:, :, start : start + n], own[i], final)
            alone[i].append(a)
        start += n
    return [np.concatenate(p) for p in together], [np.concatenate(p) for p in alone]


STACK_STEPS = [(15, False), (4, False), (4, False), (9, False), (6, True)]


@pytest.mark.parametrize("which", ["ort", "torch"])
def test_streams_stacked_in_one_forward_equal_each_alone(which, ort_backend, torch_backend):
    """Fresh streams start together and carried states stack along the batch: every stream's
    audio is what it would have been alone, on both backends."""
    backend = ort_backend if which == "ort" else torch_backend
    mels = [_mel(1, 38, seed=s).astype(np.float32) for s in (1, 2, 3)]
    together, alone = _stacked_against_alone(backend, mels, STACK_STEPS)
    for t, a, m in zip(together, alone, mels):
        assert t.shape == a.shape == (38 * 256,)
        np.testing.assert_allclose(t, a, atol=1e-5, rtol=0)
        assert np.abs(t - backend.run(m)[0]).max() <= 1e-4  # and offline synthesis
    with pytest.raises(ValueError, match=r"\[3, 80, frames\]"):
        backend.run_streams(np.zeros((2, 80, 20), np.float32), [None] * 3)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 on this CPU"
)
def test_bf16_streams_stacked_in_one_forward_track_each_alone():
    """In bf16 a stacked forward may round differently from one stream's, but each stream's
    audio stays within bf16's rounding of running alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = TorchBackend(bf16=True)
        mels = [_mel(1, 38, seed=s).astype(np.float32) for s in (1, 2, 3)]
        together, alone = _stacked_against_alone(backend, mels, STACK_STEPS)
    finally:
        torch.set_num_threads(before)
    for t, a in zip(together, alone):
        assert t.shape == a.shape == (38 * 256,)
        assert _snr_db(a, t) >= 40, _snr_db(a, t)


@pytest.mark.parametrize(
    "amx, vendor, avx512_bf16, vnni, vectors, expected, expected_int8",
    [
        # Xeon Sapphire Rapids on: bf16 on AMX tiles, calibrated or not
        (True, "GenuineIntel", True, True, "AVX512", ("torch", "bf16"), ("torch", "bf16")),
        # EPYC Zen 4 on: int8 on oneDNN with bf16 around it where the voice is calibrated,
        # else bf16
        (False, "AuthenticAMD", True, True, "AVX512", ("torch", "bf16"), ("torch", "int8")),
        # Cooper Lake: vdpbf16ps at a quarter of FMA's rate; VNNI's int8 where calibrated
        (False, "GenuineIntel", True, True, "AVX512", ("onnx", "fp32"), ("onnx", "int8")),
        # Ice Lake
        (False, "GenuineIntel", False, True, "AVX512", ("onnx", "fp32"), ("onnx", "int8")),
        # Skylake: AVX-512 without VNNI, not measured: fp32
        (False, "GenuineIntel", False, False, "AVX512", ("onnx", "fp32"), ("onnx", "fp32")),
        # EPYC Zen 3 (and Intel's AVX2 cores): ONNX Runtime's AVX2 int8 where calibrated
        (False, "AuthenticAMD", False, False, "AVX2", ("onnx", "fp32"), ("onnx", "int8")),
        (False, "GenuineIntel", False, False, "AVX2", ("onnx", "fp32"), ("onnx", "int8")),
        (False, "", False, False, "DEFAULT", ("onnx", "fp32"), ("onnx", "fp32")),
    ],
)
def test_the_default_cpu_vocoder_follows_the_cpu_and_the_voice_calibration(
    monkeypatch, amx, vendor, avx512_bf16, vnni, vectors, expected, expected_int8
):
    from vocoder_service import backends

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: vnni)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: vectors)
    monkeypatch.setattr(backends, "cpu_vendor", lambda: vendor)
    assert backends.auto_backend(torch.device("cpu")) == expected
    assert backends.auto_backend(torch.device("cpu"), int8_calibrated=True) == expected_int8
    # a GPU keeps its own precision whatever the host CPU
    assert backends.auto_backend(torch.device("cuda"), int8_calibrated=True) == ("onnx", "fp16")


def test_the_cpu_vendor_is_read_from_linux():
    from vocoder_service.backends import cpu_vendor

    with open("/proc/cpuinfo") as f:
        assert cpu_vendor() and cpu_vendor() in f.read()
