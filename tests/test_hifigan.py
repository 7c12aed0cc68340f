"""HiFi-GAN generator, checkpoint loading and the mel front end."""

import json
import shutil
import subprocess

import numpy as np
import pytest
import soundfile as sf
import torch

from vocoder_service.checkpoint import (
    GeneratorCheckpoint,
    load_generator,
    pretrained_checkpoint,
    read_state_dict,
    resolve_checkpoint,
)
from vocoder_service.hifigan import Generator, HifiGanConfig, receptive_field_frames
from vocoder_service.mel import MelSpectrogram, hz_to_mel, mel_filterbank, mel_to_hz

V3_TINY = dict(
    resblock="2",
    upsample_rates=[8, 8, 4],
    upsample_kernel_sizes=[16, 16, 8],
    upsample_initial_channel=32,
    resblock_kernel_sizes=[3, 5, 7],
    resblock_dilation_sizes=[[1, 2], [2, 6], [3, 12]],
)
V1_TINY = dict(
    resblock="1",
    upsample_rates=[8, 8, 2, 2],
    upsample_kernel_sizes=[16, 16, 4, 4],
    upsample_initial_channel=32,
    resblock_kernel_sizes=[3, 7, 11],
    resblock_dilation_sizes=[[1, 3, 5]] * 3,
)
# stages with fewer residual blocks (the first n kernels): each stage lags by its own widest
V1_FEWER_BLOCKS = {**V1_TINY, "resblocks_per_stage": [1, 2, 3, 2]}
ARCHS = pytest.mark.parametrize(
    "arch", [V1_TINY, V3_TINY, V1_FEWER_BLOCKS], ids=["V1", "V3", "V1-fewer-blocks"]
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the machine is shared: two OpenMP threads on two busy cores run several times slower
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def universal() -> Generator:
    return load_generator()


def test_pretrained_generators_consume_every_key():
    outputs = []
    mel = torch.full((1, 80, 4), -5.0)
    for name in ("universal", "LJSpeech"):
        ckpt = resolve_checkpoint(pretrained_checkpoint(name))
        sd = read_state_dict(ckpt.path)
        generator = Generator(ckpt.config)
        generator.load_state_dict(sd, strict=True)  # raises on any missing or unused key
        assert len(sd) == len(generator.state_dict()) == 234
        loaded = load_generator(ckpt)
        assert sum(p.numel() for p in loaded.parameters()) == 13_926_017
        assert not loaded.has_weight_norm and not loaded.training
        with torch.inference_mode():
            outputs.append(loaded(mel))
    assert outputs[0].shape == (1, 1, 4 * 256)
    assert outputs[0].abs().max() <= 1.0
    assert not torch.allclose(outputs[0], outputs[1])  # two different voices


@ARCHS
def test_receptive_field_is_exact(arch):
    # channel counts do not change the receptive field, so tiny widths stand in for the real ones
    config = HifiGanConfig.from_dict(arch)
    torch.manual_seed(0)
    generator = Generator(config).eval()
    mel = torch.randn(1, config.num_mels, 32, requires_grad=True)
    frame = 16
    generator(mel)[0, 0, frame * config.hop_size : (frame + 1) * config.hop_size].sum().backward()
    touched = (mel.grad[0].abs().sum(0) > 0).nonzero().flatten()
    assert receptive_field_frames(config) == (
        frame - touched.min().item(),
        touched.max().item() - frame,
    )
    if arch is V1_TINY:
        assert resolve_checkpoint().config.receptive_field == config.receptive_field == (13, 13)


def test_jik876_checkpoint_with_parametrization_keys_roundtrips(tmp_path, universal):
    ckpt = resolve_checkpoint()
    with_wn = load_generator(ckpt, remove_weight_norm=False)
    sd = with_wn.state_dict()
    assert any(k.endswith("parametrizations.weight.original1") for k in sd)
    torch.save({"generator": sd}, tmp_path / "g_00000100")
    torch.save({"generator": {}}, tmp_path / "g_00000050")  # older step: must not be picked
    shutil.copy(ckpt.path.parent / "config.json", tmp_path / "config.json")
    reloaded = load_generator(tmp_path)
    mel = torch.randn(2, 80, 12) - 5
    with torch.inference_mode():
        assert torch.equal(reloaded(mel), universal(mel))


def test_folded_safetensors_checkpoint_loads(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    generator = Generator(HifiGanConfig.from_dict(V3_TINY)).eval()
    mel = torch.randn(1, 80, 6)
    with torch.inference_mode():
        before = generator(mel)
    save_file(generator.remove_weight_norm().state_dict(), str(tmp_path / "generator.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(V3_TINY))
    with torch.inference_mode():
        after = load_generator(tmp_path)(mel)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_bad_hop_size_raises(tmp_path):
    config = json.loads((resolve_checkpoint().path.parent / "config.json").read_text())
    config["hop_size"] = 200
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(pretrained_checkpoint(), tmp_path / "generator.pth.tar")
    with pytest.raises(ValueError, match=r"prod\(upsample_rates\) = 256 but hop_size = 200"):
        resolve_checkpoint(tmp_path)


def test_weights_that_do_not_fit_the_config_raise(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**V1_TINY, "hop_size": 256}))
    shutil.copy(pretrained_checkpoint(), tmp_path / "generator.pth.tar")
    with pytest.raises(ValueError, match="does not fit its config"):
        load_generator(tmp_path)
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(tmp_path / "missing")


def test_remove_weight_norm_keeps_output():
    torch.manual_seed(2)
    generator = Generator(HifiGanConfig.from_dict(V3_TINY)).eval()
    assert generator.has_weight_norm
    mel = torch.randn(1, 80, 5)
    with torch.inference_mode():
        before = generator(mel)
        after = generator.remove_weight_norm()(mel)
    assert not generator.has_weight_norm
    assert after.shape == (1, 1, 5 * 256)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


def test_slaney_mel_scale_and_filterbank():
    assert hz_to_mel(1000.0) == pytest.approx(15.0)
    assert hz_to_mel(500.0) == pytest.approx(7.5)
    hz = np.array([0.0, 300.0, 1000.0, 4000.0, 8000.0])
    np.testing.assert_allclose(mel_to_hz(hz_to_mel(hz)), hz, atol=1e-6)
    fb = mel_filterbank(22050, 1024, 80, 0.0, 8000.0)
    assert fb.shape == (80, 513) and (fb >= 0).all()
    # Slaney normalisation: every triangle has unit area in Hz (wide filters are well sampled)
    area = fb.sum(1) * (22050 / 1024)
    np.testing.assert_allclose(area[40:], 1.0, rtol=0.03)
    assert fb[:, 513 * 8000 // 11025 + 2 :].max() == 0.0  # nothing above fmax


def _test_audio(tmp_path) -> np.ndarray:
    """Real speech from espeak-ng when installed, else a voiced harmonic signal."""
    if shutil.which("espeak-ng"):
        wav = tmp_path / "speech.wav"
        subprocess.run(
            [
                "espeak-ng",
                "-v",
                "en-us",
                "-w",
                str(wav),
                "The quick brown fox jumps over the lazy dog.",
            ],
            check=True,
            capture_output=True,
        )
        audio, sr = sf.read(wav, dtype="float32")
        assert sr == 22050
        return audio
    sr = 22050
    t = np.arange(int(1.5 * sr)) / sr
    f0 = 120 * (1 + 0.5 * np.sin(2 * np.pi * 1.3 * t))
    phase = 2 * np.pi * np.cumsum(f0) / sr
    x = sum(np.sin(k * phase) / k * (k * f0 < 5000) for k in range(1, 40))
    x = x * (0.55 + 0.45 * np.sin(2 * np.pi * 3 * t))
    return (0.3 * x / np.abs(x).max()).astype(np.float32)


def test_mel_front_end_resynthesis_matches_input(tmp_path, universal):
    audio = _test_audio(tmp_path)
    frontend = MelSpectrogram(universal.config)
    mel = frontend(audio)
    assert mel.shape == (1, 80, len(audio) // 256)
    with torch.inference_mode():
        resynth = universal(mel)[0, 0].numpy()
    again = frontend(resynth)
    corr = np.corrcoef(mel.flatten(), again.flatten())[0, 1]
    rms_ratio = np.sqrt(np.mean(resynth**2)) / np.sqrt(np.mean(audio[: len(resynth)] ** 2))
    # a front end off by a constant factor or missing Slaney normalisation gives L1 >= 1.4
    assert corr > 0.97
    assert (mel - again).abs().mean() < 0.7
    assert 0.6 < rms_ratio < 1.6


def test_mel_rejects_bad_shapes():
    frontend = MelSpectrogram(resolve_checkpoint().config)
    with pytest.raises(ValueError):
        frontend(np.zeros((1, 1, 4096), np.float32))
    with pytest.raises(ValueError):
        frontend(np.zeros(100, np.float32))


def test_config_validation():
    with pytest.raises(ValueError, match="resblock"):
        HifiGanConfig.from_dict({**V1_TINY, "resblock": "3"})
    with pytest.raises(ValueError, match="lacks"):
        HifiGanConfig.from_dict({"resblock": "1"})
    with pytest.raises(ValueError, match="even"):
        HifiGanConfig.from_dict({**V1_TINY, "upsample_kernel_sizes": [15, 16, 4, 4]})
    for counts in ([3, 3, 3], [0, 3, 3, 3], [3, 3, 3, 4]):
        with pytest.raises(ValueError, match="resblocks_per_stage needs one count per"):
            HifiGanConfig.from_dict({**V1_TINY, "resblocks_per_stage": counts})
    fewer = HifiGanConfig.from_dict(V1_FEWER_BLOCKS)
    assert HifiGanConfig.from_dict(fewer.to_dict()) == fewer
    assert "resblocks_per_stage" not in HifiGanConfig.from_dict(V1_TINY).to_dict()
    assert isinstance(resolve_checkpoint(), GeneratorCheckpoint)


@ARCHS
@pytest.mark.parametrize("chunks", [[40], [14, 1, 1, 9, 15], [20, 20, 0]])
def test_stateful_streaming_equals_offline(arch, chunks):
    """Chunk by chunk with carried layer tails, the output is offline synthesis, sample for
    sample, however the frames are split (a 0-frame final call only lets the tail out)."""
    from vocoder_service.streaming import StreamingGenerator

    torch.manual_seed(0)
    config = HifiGanConfig.from_dict(arch)
    generator = Generator(config).eval().remove_weight_norm()
    streamer = StreamingGenerator(generator)
    mel = torch.randn(1, config.num_mels, sum(chunks))
    with torch.inference_mode():
        offline = generator(mel)[0, 0]
        state, pieces, start = streamer.initial_state(), [], 0
        for i, n in enumerate(chunks):
            audio, state = streamer(mel[:, :, None, start : start + n], state, i == len(chunks) - 1)
            pieces.append(audio[0])
            start += n
    streamed = torch.cat(pieces)
    assert streamed.shape == offline.shape
    torch.testing.assert_close(streamed, offline, atol=1e-5, rtol=0)
    held_back = sum(chunks[:-1]) * config.hop_size - sum(p.numel() for p in pieces[:-1])
    assert (
        held_back > 0 or len(chunks) == 1
    )  # non-final calls keep the samples that still lack right context


def test_stateful_streaming_of_the_pretrained_generator(universal):
    from vocoder_service.streaming import StreamingGenerator

    streamer = StreamingGenerator(universal)
    mel = torch.randn(1, 80, 60) - 5
    with torch.inference_mode():
        offline = universal(mel)[0, 0]
        first, state = streamer(mel[:, :, None, :20], streamer.initial_state())
        rest, _ = streamer(mel[:, :, None, 20:], state, True)
    # 20 frames of input let out 20 frames minus the receptive field's right side (and a bit)
    assert 6 * 256 < first.shape[-1] < 8 * 256
    torch.testing.assert_close(torch.cat([first[0], rest[0]]), offline, atol=1e-5, rtol=0)


def test_a_fresh_stream_starts_from_the_initial_state():
    """`state=None` and `initial_state()` are the same start: the exported graphs are fed the
    latter, the torch path the former."""
    from vocoder_service.streaming import StreamingGenerator

    torch.manual_seed(3)
    generator = Generator(HifiGanConfig.from_dict(V1_TINY)).eval().remove_weight_norm()
    streamer = StreamingGenerator(generator)
    mel = torch.randn(1, 80, 1, 20)
    with torch.inference_mode():
        a, state_a = streamer(mel, None)
        b, state_b = streamer(mel, streamer.initial_state())
    assert torch.equal(a, b)
    assert [t.shape for t in state_a] == [t.shape for t in state_b]
    assert all(torch.equal(x, y) for x, y in zip(state_a, state_b))
