"""Fewer residual blocks: the pruned config, its start from the teacher, training, the delta."""

import dataclasses
import json
import random
import shutil
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.default_voice.distill import load_teacher, save_student
from recipes.default_voice.prune import StagePairs, export, pruned_config, stage_forward, train
from tests.test_distill import TINY, _data, _log_rows, _mels, _teacher, training_refuses
from vocoder_service.checkpoint import (
    BASE_KEY,
    inherit_weights,
    load_generator,
    resolve_checkpoint,
)
from vocoder_service.hifigan import Generator
from vocoder_service.voice import load_voice

ROOT = Path(__file__).resolve().parents[1]
VOICE = ROOT / "voices" / "default"


def test_pruned_config_drops_the_widest_block_of_each_stage_named():
    config = pruned_config(TINY, {1, 2})
    assert config.resblocks_per_stage == (3, 2, 2, 3)
    assert [[k for k, _ in blocks] for blocks in config.stage_blocks()] == [
        [3, 7, 11],
        [3, 7],
        [3, 7],
        [3, 7, 11],
    ]
    # the kernel-11 blocks set the reach of their stages: without the first stage's (60 samples
    # at 8 a frame) a frame needs 3 fewer frames of right context
    assert pruned_config(TINY, {0}).receptive_field[1] == TINY.receptive_field[1] - 3
    assert len(Generator(config).resblocks) == 10
    with pytest.raises(ValueError, match="stage 4 is not one"):
        pruned_config(TINY, {4})
    with pytest.raises(ValueError, match="single residual block"):
        pruned_config(dataclasses.replace(config, resblocks_per_stage=(1,) * 4), {0})


def test_a_pruned_generator_starts_from_the_teachers_blocks():
    teacher = _teacher()
    student = Generator(pruned_config(TINY, {1})).remove_weight_norm().eval()
    inherit_weights(teacher, student)
    mel = _mels(1)[0][None]
    with torch.no_grad():
        # stage 1 alone differs: the mean of the teacher's first two blocks there
        x = torch.randn(1, TINY.upsample_initial_channel // 4, 50)
        blocks = teacher.resblocks[teacher.stage_slices[1]]
        want = (blocks[0](x) + blocks[1](x)) / 2
        assert torch.equal(stage_forward(student, 1, x), want)
        assert torch.equal(stage_forward(student, 2, x[:, :4]), stage_forward(teacher, 2, x[:, :4]))
        assert not torch.allclose(student(mel), teacher(mel))
    assert torch.equal(student.ups[1].weight, teacher.ups[1].weight)
    wider = Generator(TINY).remove_weight_norm()
    with pytest.raises(ValueError, match="more residual blocks"):
        inherit_weights(student, wider)


def test_stage_windows_are_what_the_teacher_computed_there():
    teacher = _teacher()
    pairs = StagePairs(teacher, _mels(2, 40), [1])
    x, y = pairs.batch(1, 3, 64, 36, random.Random(0))
    assert x.shape == (3, 8, 64 + 72) and y.shape == (3, 8, 64)
    with torch.no_grad():
        got = stage_forward(teacher, 1, x)[..., 36 : 36 + 64]
    # fp16 activations: the window's own computation equals the whole utterance's there
    assert (got - y).abs().max() < 2e-2 * y.abs().max()
    assert len(pairs.audio) == 2 and pairs.audio[0].shape == (40 * TINY.hop_size,)


def _args(data: Path, out: Path, **kw) -> Namespace:
    args = dict(
        data=data,
        voice=VOICE,
        out=out,
        stages={1, 2},
        minutes=0.004,
        frames=10_000,
        held_out=2,
        batch=2,
        segment=8,
        lr=5e-4,
        bf16=False,
        joint_from=0.5,
        joint_batch=2,
        seed=0,
        save_every=60.0,
    )
    args.update(kw)
    return Namespace(**args)


def test_training_changes_only_the_pruned_stages_blocks(tmp_path):
    data = _data(tmp_path / "data")
    out = tmp_path / "pruned"
    train(_args(data, out))
    rows = _log_rows(out)
    assert rows[0]["step"] == 0 and rows[-1]["final"] and rows[-1]["step"] >= 2
    assert all(np.isfinite(r["mel_l1"]) for r in rows)
    assert "stage1_snr_db" in rows[-1] or "train_joint_loss" in rows[-1]
    student = load_generator(resolve_checkpoint(out))
    assert student.config.resblocks_per_stage == (3, 2, 2, 3)
    start = Generator(student.config).remove_weight_norm()
    inherit_weights(load_teacher(data, torch.device("cpu")), start)  # fp16-rounded weights
    changed = {
        name.split(".")[1]
        for name, p in student.state_dict().items()
        if not torch.equal(p, start.state_dict()[name])
    }
    assert changed and changed <= {"3", "4", "5", "6"}  # stages 1 and 2's blocks alone


def test_joint_phase_trains_on_the_whole_generators_audio(tmp_path):
    out = tmp_path / "pruned"
    train(_args(_data(tmp_path / "data"), out, joint_from=0.0, stages={1}))
    trained = [r for r in _log_rows(out) if "train_joint_loss" in r]
    assert trained and all(r["train_joint_loss"] > 0 for r in trained)


def test_export_writes_only_the_retrained_blocks_over_the_universal_generator(tmp_path):
    universal = load_generator()
    student = Generator(pruned_config(universal.config, {1})).remove_weight_norm().eval()
    inherit_weights(universal, student)
    with torch.no_grad():
        for p in student.resblocks[student.stage_slices[1]].parameters():
            p.mul_(0.9)
    save_student(student, tmp_path / "student")
    voice = tmp_path / "voice"
    shutil.copytree(VOICE, voice, ignore=shutil.ignore_patterns("*.wav", "*.png"))
    export(tmp_path / "student", voice)

    config = json.loads((voice / "vocoder" / "config.json").read_text())
    assert config[BASE_KEY] == "universal" and config["resblocks_per_stage"] == [3, 2, 3, 3]
    from safetensors.torch import load_file

    delta = load_file(str(voice / "vocoder" / "generator.safetensors"))
    assert delta and all(k.startswith(("resblocks.3.", "resblocks.4.")) for k in delta)
    loaded = load_voice(voice)
    assert loaded.generator.base is not None
    assert loaded.generator.fingerprint != resolve_checkpoint().fingerprint
    mel = torch.randn(1, 80, 30) - 5
    with torch.no_grad():
        got = load_generator(loaded.generator)(mel)
        want = student(mel)
    assert (got - want).abs().max() < 1e-2  # the retrained blocks are fp16 in the voice


def test_a_delta_without_its_weights_is_refused(tmp_path):
    folder = tmp_path / "gen"
    folder.mkdir()
    config = {**pruned_config(load_generator().config, {1}).to_dict(), BASE_KEY: "universal"}
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({"resblocks.3.convs1.0.bias": torch.zeros(3)}, str(folder / "generator.safetensors"))
    with pytest.raises(ValueError, match="does not fit its config"):
        load_generator(resolve_checkpoint(folder))
    (folder / "config.json").write_text(json.dumps({**config, BASE_KEY: "mine"}))
    with pytest.raises(ValueError, match="base_generator must name a pretrained generator"):
        resolve_checkpoint(folder)


@pytest.mark.parametrize(
    "flags, rule",
    [
        (["--stages", "7"], "--stages: stage 7 is not one"),
        (["--joint-from", "2"], "--joint-from must be a fraction"),
        (["--batch", "0"], "--batch must be positive"),
    ],
)
def test_bad_training_flags_exit_2_with_one_line(tmp_path, flags, rule):
    training_refuses("recipes.default_voice.prune", tmp_path, flags, rule)
