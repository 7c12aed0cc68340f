"""HiFi-GAN V1 with fewer residual blocks in some stages, the rest retrained to stand in for them.

Each of V1's four stages averages three residual blocks, of kernels 3, 7 and 11; the kernel-11
block is 11/21 of its stage's multiplies and its widest reach. `train` drops the last block of
each stage in `--stages` (0-based) and retrains the blocks that stay so that their mean gives
what the teacher's stage gave, from the teacher's own input to that stage: one regression per
stage, on the teacher's activations over the voice's own decoded mels (`distill prepare`'s
codes). Every other layer keeps the teacher's weights. A stage's blocks are a small part of the
network, so this trains on a CPU, unlike a distilled student of the whole network
(`distill.py`); what it buys is fewer multiplies (stages 0-2: 45%) and less right context.

    python -m recipes.default_voice.distill prepare                        # CPU, ~3 min
    python -m recipes.default_voice.prune train --stages 1 --bf16 --out DIR   # 62 min, 1 thread
    python -m recipes.default_voice.prune export --student DIR --voice VOICE

Every `--save-every` seconds `train` writes the generator (`generator.safetensors`,
`config.json`) and a line of `log.jsonl`: each stage's regression error on its training crops
and, for the whole pruned generator on held-out utterances, log-mel L1 and SNR against the
teacher's audio. Judge the exported voice with `vocoder_precision --compare-universal`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.default_voice.distill import (
    CODES,
    STUDENT,
    TEACHER_CONFIG,
    Crops,
    SpectralLoss,
    held_out,
    load_teacher,
    save_student,
)
from vocoder_service.checkpoint import (
    BASE_KEY,
    inherit_weights,
    load_generator,
    resolve_checkpoint,
)
from vocoder_service.hifigan import OFFLINE, Generator, HifiGanConfig, Offline, resblock_reach
from vocoder_service.token_decoder import load_token_decoder
from vocoder_service.voice import utterance_codes

ROOT = Path(__file__).resolve().parents[2]


def _log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pruned_config(teacher: HifiGanConfig, stages: set[int]) -> HifiGanConfig:
    """The teacher's config with the last residual block of each stage in `stages` dropped."""
    counts = [len(blocks) for blocks in teacher.stage_blocks()]
    for s in stages:
        if not 0 <= s < len(counts):
            raise ValueError(f"stage {s} is not one of the generator's {len(counts)} stages")
        if counts[s] < 2:
            raise ValueError(f"stage {s} has a single residual block; none can be dropped")
        counts[s] -= 1
    return dataclasses.replace(teacher, resblocks_per_stage=tuple(counts))


class _StageRecorder(Offline):
    """Offline layers that keep each upsampling stage's input (the upsampler's output) and
    output (the mean of its residual blocks), as fp16, in forward order."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def conv_transpose(self, layer, x, slope=None):
        y = super().conv_transpose(layer, x, slope)
        self.inputs.append(y[0].half())
        return y

    def average(self, branches, lagging):
        y = super().average(branches, lagging)
        self.outputs.append(y[0].half())
        return y


class StagePairs:
    """The teacher's (input, output) of each retrained stage on whole utterances, and its audio;
    `batch` cuts random windows: `segment` samples of output with `reach` samples of input on
    each side (so the student's output there does not see the window's zero padding)."""

    def __init__(self, teacher: Generator, mels: list[torch.Tensor], stages: list[int]):
        self.pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {s: [] for s in stages}
        self.audio: list[torch.Tensor] = []
        with torch.inference_mode():
            for mel in mels:
                rec = _StageRecorder()
                self.audio.append(teacher(mel[None], rec)[0, 0].clone())
                for s in stages:
                    self.pairs[s].append((rec.inputs[s], rec.outputs[s]))

    def batch(
        self, stage: int, size: int, segment: int, reach: int, rng: random.Random
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = self.pairs[stage]
        usable = [k for k, (x, _) in enumerate(pairs) if x.shape[-1] >= segment + 2 * reach]
        weights = [pairs[k][0].shape[-1] for k in usable]
        xs, ys = [], []
        for k in rng.choices(usable, weights=weights, k=size):
            x, y = pairs[k]
            s = rng.randrange(reach, x.shape[-1] - segment - reach + 1)
            xs.append(x[:, s - reach : s + segment + reach])
            ys.append(y[:, s : s + segment])
        return torch.stack(xs).float(), torch.stack(ys).float()


def stage_forward(student: Generator, stage: int, x: torch.Tensor) -> torch.Tensor:
    """The mean of one stage's residual blocks on `x`, offline."""
    blocks = student.resblocks[student.stage_slices[stage]]
    return OFFLINE.average([b(x) for b in blocks], student.lagging[stage])


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    teacher = load_teacher(args.data, torch.device("cpu"))
    decoder = load_token_decoder(args.voice / "vocoder")
    if decoder is None:
        raise SystemExit(f"{args.voice} has no token decoder")
    utterances = utterance_codes(args.data / CODES)
    rng.shuffle(utterances)
    with torch.inference_mode():
        mels = [decoder(torch.from_numpy(c)[None])[0].clone() for c in utterances]
    val = mels[: args.held_out]
    train_mels, frames = [], 0
    for mel in mels[args.held_out :]:
        if frames >= args.frames:
            break
        train_mels.append(mel)
        frames += mel.shape[-1]
    with torch.inference_mode():
        val_targets = [teacher(m[None])[0, 0].clone() for m in val]
    stages = sorted(args.stages)
    pairs = StagePairs(teacher, train_mels, stages)
    _log(
        f"{len(train_mels)} training utterances ({frames} frames), {len(val)} held out; "
        f"teacher activations in {time.perf_counter() - started:.0f} s"
    )

    config = pruned_config(teacher.config, set(stages))
    student = Generator(config).remove_weight_norm()
    inherit_weights(teacher, student)
    del teacher
    student.requires_grad_(False)
    trained = [student.resblocks[student.stage_slices[s]] for s in stages]
    params = [p for blocks in trained for p in blocks.parameters()]
    for p in params:
        p.requires_grad_(True)
    reach = {
        s: max(resblock_reach(config, k, d) for k, d in config.stage_blocks()[s]) for s in stages
    }
    rates = [math.prod(config.upsample_rates[: s + 1]) for s in range(len(config.upsample_rates))]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.8, 0.99), weight_decay=0.0)
    loss_fn = SpectralLoss(config, torch.device("cpu"))
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "log.jsonl"
    log.write_text("")
    budget = args.minutes * 60
    running: dict[int | str, list[float]] = {s: [] for s in [*stages, "joint"]}
    # the joint phase: the whole pruned generator on mel crops against the teacher's audio,
    # so that each stage also learns what the stages after it make of its error
    crops = Crops(
        train_mels, pairs.audio, args.segment, max(config.receptive_field) + 2, config.hop_size, rng
    )

    def checkpoint(**fields) -> None:
        row = {**held_out(student, loss_fn, val, val_targets), **fields}
        for s, values in running.items():
            if values:
                mean = sum(values) / len(values)
                if s == "joint":
                    row["train_joint_loss"] = mean
                else:
                    row[f"stage{s}_snr_db"] = -10 * math.log10(mean)
                running[s] = []
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        _log(json.dumps(row))
        save_student(student, args.out)

    checkpoint(step=0, seconds=0.0)
    t0, step, next_save = time.perf_counter(), 0, args.save_every
    while (elapsed := time.perf_counter() - t0) < budget:
        lr = args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        for group in opt.param_groups:
            group["lr"] = lr
        total = torch.zeros(())
        if elapsed >= args.joint_from * budget:
            x, target, offsets = crops.batch(args.joint_batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                out = student(x)[:, 0]
            n = target.shape[-1]
            y = torch.stack([out[i, off : off + n] for i, off in enumerate(offsets)]).float()
            total = loss_fn(y, target)["total"]
            running["joint"].append(total.item())
        for s in stages if elapsed < args.joint_from * budget else ():
            segment = args.segment * rates[s]
            x, y = pairs.batch(s, args.batch, segment, reach[s], rng)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                out = stage_forward(student, s, x)[..., reach[s] : reach[s] + segment]
            # error relative to the target's power: each stage weighs the same
            err = F.mse_loss(out.float(), y) / y.square().mean().clamp(min=1e-8)
            running[s].append(err.item())
            total = total + err
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        step += 1
        if elapsed >= next_save:
            checkpoint(step=step, seconds=round(elapsed, 1), lr=lr)
            next_save += args.save_every
    checkpoint(step=step, seconds=round(time.perf_counter() - t0, 1), final=True)


def export(student_dir: Path, voice: Path) -> None:
    """Put a pruned generator into the voice: config.json naming the universal generator as
    its base, and only the weights that differ from the base's (the retrained blocks, fp16)."""
    from safetensors.torch import save_file

    student = load_generator(resolve_checkpoint(student_dir))
    if student.config.resblocks_per_stage is None:
        raise SystemExit(f"{student_dir} holds no pruned generator (no resblocks_per_stage)")
    inherited = Generator(student.config).remove_weight_norm()
    inherit_weights(load_generator(), inherited)
    base = inherited.state_dict()
    # training read the teacher in fp16 (`distill prepare`): a layer it left alone is the base's
    # up to that rounding, and the base's own weights serve it
    delta = {
        k: v.half().contiguous()
        for k, v in student.state_dict().items()
        if not torch.equal(v.half(), base[k].half())
    }
    target = voice / "vocoder"
    for old in target.glob("generator*"):
        old.unlink()
    save_file(delta, str(target / STUDENT))
    config = {**student.config.to_dict(), BASE_KEY: "universal"}
    (target / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    check = load_generator(resolve_checkpoint(target))  # fails loudly when they do not fit
    assert check.config == student.config
    kept = sum(v.numel() for v in delta.values()) / 1e6
    _log(f"{len(delta)} tensors ({kept:.2f} M weights) -> {target / STUDENT}")


def _stage_list(value: str) -> set[int]:
    try:
        return {int(s) for s in value.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of stage numbers (got {value!r})"
        ) from None


def main() -> None:
    from recipes.default_voice.config import RecipeConfig

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="drop residual blocks and retrain the rest of their stages")
    tr.add_argument("--data", type=Path, default=RecipeConfig.cache / "distill")
    tr.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    tr.add_argument("--out", type=Path, required=True)
    tr.add_argument(
        "--stages",
        type=_stage_list,
        default={1},
        help="0-based stages that lose their last residual block",
    )
    tr.add_argument("--minutes", type=float, default=62.0, help="training wall-clock budget")
    tr.add_argument("--frames", type=int, default=30_000, help="mel frames of teacher activations")
    tr.add_argument("--held-out", type=int, default=16, help="held-out utterances")
    tr.add_argument("--batch", type=int, default=8)
    tr.add_argument("--segment", type=int, default=16, help="mel frames of output per window")
    tr.add_argument("--lr", type=float, default=5e-4)
    tr.add_argument("--bf16", action="store_true", help="bf16 autocast (oneDNN's bf16 convs)")
    tr.add_argument(
        "--joint-from",
        type=float,
        default=0.5,
        help="fraction of the budget after which the whole generator trains on its audio",
    )
    tr.add_argument("--joint-batch", type=int, default=4, help="mel crops per joint step")
    tr.add_argument("--seed", type=int, default=1234)
    tr.add_argument("--save-every", type=float, default=120.0, help="seconds between checkpoints")
    ex = sub.add_parser("export", help="install a pruned generator into a voice, as a delta")
    ex.add_argument("--student", type=Path, required=True)
    ex.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    args = p.parse_args()
    if args.command == "export":
        export(args.student, args.voice)
        return
    if not 0 <= args.joint_from <= 1:
        p.error("--joint-from must be a fraction of the budget, from 0 to 1")
    for flag in (
        "minutes",
        "frames",
        "held_out",
        "batch",
        "segment",
        "lr",
        "save_every",
        "joint_batch",
    ):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if not (args.data / TEACHER_CONFIG).is_file():
        p.error(f"--data {args.data} holds no teacher: run `distill prepare` first")
    try:
        pruned_config(HifiGanConfig.from_json(args.data / TEACHER_CONFIG), args.stages)
    except ValueError as exc:
        p.error(f"--stages: {exc}")
    train(args)


if __name__ == "__main__":
    main()
