"""The distilled generator's recipe: pruned start, losses, a short training run, export."""

import dataclasses
import json
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.default_voice.discriminators import (
    PERIODS,
    Discriminators,
    discriminator_loss,
    feature_matching,
    generator_loss,
)
from recipes.default_voice.distill import (
    SpectralLoss,
    export,
    prune_init,
    student_config,
    train,
    write_teacher,
)
from tests.test_hifigan import V1_TINY
from vocoder_service.checkpoint import load_generator, resolve_checkpoint
from vocoder_service.hifigan import Generator, HifiGanConfig
from vocoder_service.voice import load_voice

ROOT = Path(__file__).resolve().parents[1]
VOICE = ROOT / "voices" / "default"
TINY = HifiGanConfig.from_dict(V1_TINY)


def _teacher(seed: int = 0) -> Generator:
    torch.manual_seed(seed)
    return Generator(TINY).remove_weight_norm().eval()


def _mels(n: int = 3, frames: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(80, frames, generator=g) - 5 for _ in range(n)]


def test_pruning_at_full_width_is_the_teacher():
    teacher = _teacher()
    student = Generator(student_config(TINY, 32)).remove_weight_norm().eval()
    prune_init(teacher, student, _mels())
    mel = _mels(1, 50)[0][None]
    with torch.no_grad():
        assert torch.equal(student(mel), teacher(mel))


def test_pruning_keeps_whole_teacher_channels():
    teacher = _teacher()
    student = Generator(student_config(TINY, 16)).remove_weight_norm().eval()
    prune_init(teacher, student, _mels())
    t, s = dict(teacher.named_parameters()), dict(student.named_parameters())
    for name, w in s.items():
        assert w.shape != t[name].shape or name.endswith("conv_post.bias"), name
    # every kept output of conv_pre is one of the teacher's rows, bias and all, none twice
    rows = [
        int((t["conv_pre.weight"] == row).all(dim=(1, 2)).nonzero()) for row in s["conv_pre.weight"]
    ]
    assert len(set(rows)) == 16 and rows == sorted(rows)
    assert torch.equal(s["conv_pre.bias"], t["conv_pre.bias"][rows])
    # the first upsampler reads exactly those channels and writes a subset of its own
    t_up, s_up = t["ups.0.weight"], s["ups.0.weight"]
    cols = [int((t_up[rows[0]] == s_up[0, j]).all(dim=1).nonzero()) for j in range(s_up.shape[1])]
    assert torch.equal(s_up, t_up[rows][:, cols])


def test_pruning_refuses_the_v3_block():
    v3 = dataclasses.replace(
        TINY,
        resblock="2",
        upsample_rates=(8, 8, 4),
        upsample_kernel_sizes=(16, 16, 8),
        resblock_kernel_sizes=(3, 5, 7),
        resblock_dilation_sizes=((1, 2), (2, 6), (3, 12)),
    )
    g = Generator(v3).remove_weight_norm()
    with pytest.raises(ValueError, match="resblock '1'"):
        prune_init(g, g, _mels(1))


def test_spectral_loss_is_zero_only_at_the_target():
    loss = SpectralLoss(TINY, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    target = 0.1 * torch.randn(2, 8192, generator=g)
    same = loss(target.clone(), target)
    assert all(v.item() == pytest.approx(0.0, abs=1e-5) for v in same.values())
    y = (target + 0.01 * torch.randn(2, 8192, generator=g)).requires_grad_()
    parts = loss(y, target)
    assert all(v.item() > 0 for v in parts.values())
    parts["total"].backward()
    assert y.grad is not None and y.grad.abs().sum() > 0


def _data(folder: Path, utterances: int = 6) -> Path:
    write_teacher(_teacher(), folder)
    rng = np.random.default_rng(3)
    lengths = rng.integers(40, 60, size=utterances).astype(np.int32)
    np.savez(
        folder / "codes.npz",
        codes=rng.integers(0, 1024, size=int(lengths.sum())).astype(np.int16),
        lengths=lengths,
        langs=np.array(["en"] * utterances),
    )
    return folder


def _args(data: Path, out: Path, **kw) -> Namespace:
    args = dict(
        data=data,
        voice=VOICE,
        out=out,
        width=16,
        minutes=0.002,
        batch=2,
        segment=8,
        lr=5e-4,
        seed=0,
        limit=None,
        device="cpu",
        save_every=60.0,
        adversarial_from=1.0,
        init=None,
    )
    args.update(kw)
    return Namespace(**args)


def _log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_training_writes_a_student_the_voice_loads(tmp_path):
    data = _data(tmp_path / "data")
    out = tmp_path / "student"
    train(_args(data, out))
    rows = _log_rows(out)
    assert rows[0]["step"] == 0 and rows[-1]["final"] and rows[-1]["step"] >= 1
    assert all(np.isfinite(r["mel_l1"]) and np.isfinite(r["snr_db"]) for r in rows)
    assert "train_adv" not in rows[1]  # regression only
    student = load_generator(resolve_checkpoint(out))
    assert student.config.upsample_initial_channel == 16
    assert student.config.upsample_rates == TINY.upsample_rates

    voice = tmp_path / "voice"
    shutil.copytree(VOICE, voice, ignore=shutil.ignore_patterns("*.wav", "*.png"))
    assert load_voice(voice).config.upsample_initial_channel == 512  # the universal V1
    export(out, voice)
    loaded = load_voice(voice)
    assert loaded.config.upsample_initial_channel == 16
    mel = torch.randn(1, 80, 30) - 5
    with torch.no_grad():
        want = student(mel)
        got = load_generator(loaded.generator)(mel)
    assert (got - want).abs().max() < 1e-2  # fp16 weights in the bundle


def test_adversarial_stage_from_a_saved_student(tmp_path):
    data = _data(tmp_path / "data")
    first, second = tmp_path / "first", tmp_path / "second"
    train(_args(data, first))
    start = load_generator(resolve_checkpoint(first))
    train(_args(data, second, init=first, adversarial_from=0.0, segment=16))
    rows = _log_rows(second)
    assert rows[0]["mel_l1"] == pytest.approx(_log_rows(first)[-1]["mel_l1"], rel=1e-5)
    trained = [r for r in rows if "train_adv" in r]
    assert trained and all(r["train_disc"] > 0 and r["train_fm"] > 0 for r in trained)
    after = load_generator(resolve_checkpoint(second))
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), after.parameters()))
    with pytest.raises(SystemExit, match="width-32"):
        train(_args(data, tmp_path / "third", init=first, width=32))


def test_discriminators_score_every_layer():
    torch.manual_seed(0)
    d = Discriminators()
    audio = 0.1 * torch.randn(2, 1, 4100)  # not a multiple of any period
    scores, maps = d(audio)
    assert len(scores) == len(PERIODS) + 3 and len(maps) == len(scores)
    assert all(s.shape[0] == 2 and s.ndim == 2 for s in scores)
    assert [len(m) for m in maps] == [6] * len(PERIODS) + [8] * 3
    ones, zeros = [torch.ones(2, 5)], [torch.zeros(2, 5)]
    assert discriminator_loss(ones, zeros).item() == 0.0
    assert discriminator_loss(zeros, ones).item() == 2.0
    assert generator_loss(ones).item() == 0.0 and generator_loss(zeros).item() == 1.0
    assert feature_matching(maps, maps).item() == 0.0


@pytest.mark.parametrize(
    "flags, rule",
    [
        (["--batch", "0"], "--batch must be positive"),
        (["--adversarial-from", "1.5"], "--adversarial-from must be a fraction"),
        (["--width", "0"], "--width: must be positive"),
        (["--width", "100"], "--width: upsample_initial_channel must halve cleanly"),
    ],
)
def test_bad_training_flags_exit_2_with_one_line(tmp_path, flags, rule):
    training_refuses("recipes.default_voice.distill", tmp_path, [*flags, "--device", "cpu"], rule)


def training_refuses(module: str, tmp_path: Path, flags: list[str], rule: str) -> None:
    """`python -m module train` on prepared data with `flags` exits 2 with `rule` on its last
    line, no traceback and no output folder."""
    data = _data(tmp_path / "data")
    out = subprocess.run(
        [sys.executable, "-m", module, "train", "--data", str(data)]
        + ["--out", str(tmp_path / "out"), *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert rule in out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()


def test_training_without_prepared_data_says_so(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "recipes.default_voice.distill", "train"]
        + ["--data", str(tmp_path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "run `prepare` first" in out.stderr
