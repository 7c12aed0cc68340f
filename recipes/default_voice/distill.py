"""A lighter HiFi-GAN for the default voice, distilled from the universal V1 on the voice's own mels.

The student is the same network at a narrower width (`--width 128` is HiFi-GAN V2's shape, 256
halfway between V2 and V1: a quarter of V1's multiplies). It learns to reproduce the teacher's
waveform, which is a deterministic function of the mel: first by regression alone, then (after
`--adversarial-from` of the budget) with HiFi-GAN's discriminators as well, since regression
alone left the audio intelligible but noisy (`bench/README.md`). Its inputs are the mels the
service feeds it: the voice's speech tokens (the teacher audio's nearest codebook rows) through
the voice's token decoder.

    python -m recipes.default_voice.distill prepare [--en 4000 --zh 1000]   # CPU, ~3 min
    python -m recipes.default_voice.distill train --width 256 --minutes 7 --out DIR   # a GPU
    python -m recipes.default_voice.distill export --student DIR [--voice voices/default]

`prepare` writes the codes and the teacher's weights (weight norm folded, fp16) to
`<cache>/distill/`; `train` needs only that folder, the voice and torch, so it runs on a machine
without the recipe's system tools. Every minute `train` writes the student and a line of its
held-out figures against the teacher (`log.jsonl`). Judge the exported voice with
`python -m recipes.default_voice.vocoder_precision --compare-universal`, by WER and DNSMOS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from recipes.default_voice.discriminators import (
    Discriminators,
    discriminator_loss,
    feature_matching,
    generator_loss,
)
from vocoder_service.checkpoint import load_generator, resolve_checkpoint
from vocoder_service.hifigan import LRELU_SLOPE, Generator, HifiGanConfig, Offline
from vocoder_service.mel import mel_filterbank
from vocoder_service.token_decoder import load_token_decoder
from vocoder_service.voice import utterance_codes

ROOT = Path(__file__).resolve().parents[2]
TEACHER = "teacher.safetensors"
TEACHER_CONFIG = "teacher_config.json"
CODES = "codes.npz"
STUDENT = "generator.safetensors"
# loss weights: HiFi-GAN's mel term, a multi-resolution STFT term and the waveform itself (the
# teacher's phase is a function of its input, so the student can and should follow it)
MEL_WEIGHT, STFT_WEIGHT, WAVE_WEIGHT = 45.0, 1.0, 10.0
FM_WEIGHT = 2.0  # the adversarial stage's feature matching, as HiFi-GAN weighs it
STFT_RESOLUTIONS = ((512, 128), (1024, 256), (2048, 512))


def _log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- prepare (CPU, recipe tools)


def _utterance_mel(item: tuple[str, str]) -> np.ndarray | None:
    """Teacher audio -> trimmed log-mel `[80, frames]` fp16, or None when it fails or is short."""
    from recipes.default_voice.data import teacher_audio, teacher_mel
    from recipes.default_voice.teacher import trim_bounds

    text, lang = item
    try:
        audio, phones = teacher_audio(text, lang)
    except (subprocess.CalledProcessError, ValueError, OSError) as exc:
        _log(f"skip {text!r}: {exc}")
        return None
    start, end = trim_bounds(phones, len(audio))
    frames = (end - start) // 256
    if frames < 64:
        return None
    return teacher_mel(audio[start : start + frames * 256])[:, :frames].astype(np.float16)


def training_items(cache: Path, en: int, zh: int) -> list[tuple[str, str]]:
    """The first `en` English and `zh` Mandarin training sentences, as (text, language)."""
    from recipes.default_voice.config import RecipeConfig
    from recipes.default_voice.data import sentences

    splits = sentences(dataclasses.replace(RecipeConfig(), cache=cache))
    return [(t, "en") for t in splits["en_train"][:en]] + [
        (t, "zh") for t in splits["zh_train"][:zh]
    ]


def teacher_codes(
    items: list[tuple[str, str]], voice: Path, workers: int
) -> tuple[list[np.ndarray], list[str]]:
    """The teacher's audio of each (text, language), as the voice's speech codes (int16), and
    each kept utterance's language; failed or short utterances are left out."""
    from concurrent.futures import ProcessPoolExecutor

    from recipes.default_voice.tokens import assign, stacked

    decoder = load_token_decoder(voice / "vocoder")
    if decoder is None:
        raise SystemExit(f"{voice} has no token decoder")
    codebook = decoder.codebook.detach().float()
    fpt = decoder.config.frames_per_token
    codes, langs = [], []
    started = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        for k, mel in enumerate(pool.map(_utterance_mel, items, chunksize=16)):
            if mel is not None:
                vectors = torch.from_numpy(stacked(mel.astype(np.float32), fpt))
                codes.append(assign(vectors, codebook).numpy().astype(np.int16))
                langs.append(items[k][1])
            if (k + 1) % 500 == 0:
                _log(f"{k + 1}/{len(items)} sentences, {time.perf_counter() - started:.0f} s")
    hours = sum(len(c) for c in codes) * fpt * 256 / 22050 / 3600
    _log(f"{len(codes)} utterances, {hours:.2f} h of teacher audio")
    return codes, langs


def prepare(cache: Path, voice: Path, en: int, zh: int, workers: int) -> Path:
    """Teacher mels of the voice's training sentences -> their codes; the teacher's weights."""
    out = cache / "distill"
    out.mkdir(parents=True, exist_ok=True)
    codes, langs = teacher_codes(training_items(cache, en, zh), voice, workers)
    np.savez(
        out / CODES,
        codes=np.concatenate(codes),
        lengths=np.array([len(c) for c in codes], dtype=np.int32),
        langs=np.array(langs),
    )
    write_teacher(load_generator(resolve_checkpoint()), out)
    _log(f"codes and teacher weights -> {out}")
    return out


# ---------------------------------------------------------------- train (any torch device)


def write_teacher(generator: Generator, out: Path) -> None:
    """The teacher as `train` reads it: plain (folded) weights in fp16 and its config."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = generator.remove_weight_norm().state_dict()
    save_file({k: v.half().contiguous() for k, v in sd.items()}, str(out / TEACHER))
    (out / TEACHER_CONFIG).write_text(json.dumps(generator.config.to_dict(), indent=1))


def load_teacher(data: Path, device: torch.device) -> Generator:
    from safetensors.torch import load_file

    teacher = Generator(HifiGanConfig.from_json(data / TEACHER_CONFIG)).remove_weight_norm()
    teacher.load_state_dict({k: v.float() for k, v in load_file(str(data / TEACHER)).items()})
    return teacher.eval().to(device)


def student_config(teacher: HifiGanConfig, width: int) -> HifiGanConfig:
    if width <= 0:
        raise ValueError(f"must be positive (got {width})")
    return dataclasses.replace(teacher, upsample_initial_channel=width)


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Per-channel RMS over batch and time of `[B, C, T]`."""
    return x.float().square().mean(dim=(0, 2)).sqrt()


class _Recorder(Offline):
    """Runs the layers offline and keeps each channel's RMS at the outputs pruning ranks: the
    residual streams' producers and each unit's inner channels (after their leaky ReLU)."""

    def __init__(self, generator: Generator):
        self.names = {
            id(m): name
            for name, m in generator.named_modules()
            if name == "conv_pre" or name.startswith("ups.") or ".convs1." in name
        }
        self.acts: dict[str, list[torch.Tensor]] = {}

    def _keep(self, layer: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
        name = self.names.get(id(layer))
        if name is not None:
            a = F.leaky_relu(y, LRELU_SLOPE) if ".convs1." in name else y
            self.acts.setdefault(name, []).append(_rms(a))
        return y

    def conv(self, layer, x, slope=None):
        return self._keep(layer, super().conv(layer, x, slope))

    def conv_transpose(self, layer, x, slope=None):
        return self._keep(layer, super().conv_transpose(layer, x, slope))


@torch.no_grad()
def prune_init(teacher: Generator, student: Generator, mels: list[torch.Tensor]) -> None:
    """Start the student from the teacher's most used channels: each channel set (a stage's
    residual stream, a residual unit's inner channels) keeps the channels with the largest
    activation RMS on `mels` times the norm of the weights that read them. Both are "1"-block
    generators with plain (folded) weights and the same layout."""
    if teacher.config.resblock != "1" or student.config.resblock != "1":
        raise ValueError("prune_init takes generators of resblock '1' (HiFi-GAN V1/V2 layout)")
    recorder = _Recorder(teacher)
    for mel in mels:
        teacher(mel[None], recorder)
    rms = {name: torch.stack(v).mean(0) for name, v in recorder.acts.items()}
    t = dict(teacher.named_modules())
    s = dict(student.named_modules())
    stages = len(teacher.ups)

    def top(score: torch.Tensor, n: int) -> torch.Tensor:
        return score.topk(n).indices.sort().values

    # residual streams: conv_pre's outputs, then each upsampler's outputs
    streams = []
    for i in range(stages + 1):
        producer = "conv_pre" if i == 0 else f"ups.{i - 1}"
        if i < stages:  # read by the next upsampler ([in, out, k])
            reads = t[f"ups.{i}"].weight.flatten(1).norm(dim=1)
        else:  # read by conv_post ([out, in, k])
            reads = t["conv_post"].weight.transpose(0, 1).flatten(1).norm(dim=1)
        width = s[producer].weight.shape[0 if i == 0 else 1]
        streams.append(top(rms[producer] * reads, width))
    stw = dict(student.named_parameters())
    stw["conv_pre.weight"].copy_(t["conv_pre"].weight[streams[0]])
    stw["conv_pre.bias"].copy_(t["conv_pre"].bias[streams[0]])
    for i in range(stages):
        w = t[f"ups.{i}"].weight[streams[i]][:, streams[i + 1]]
        stw[f"ups.{i}.weight"].copy_(w)
        stw[f"ups.{i}.bias"].copy_(t[f"ups.{i}"].bias[streams[i + 1]])
    stage_of = [
        i for i, part in enumerate(teacher.stage_slices) for _ in range(part.start, part.stop)
    ]
    for j, block in enumerate(teacher.resblocks):
        keep = streams[stage_of[j] + 1]
        for m, (c1, c2) in enumerate(zip(block.convs1, block.convs2)):
            name = f"resblocks.{j}.convs1.{m}"
            reads = c2.weight.transpose(0, 1).flatten(1).norm(dim=1)
            inner = top(rms[name] * reads, s[name].weight.shape[0])
            stw[f"{name}.weight"].copy_(c1.weight[inner][:, keep])
            stw[f"{name}.bias"].copy_(c1.bias[inner])
            stw[f"resblocks.{j}.convs2.{m}.weight"].copy_(c2.weight[keep][:, inner])
            stw[f"resblocks.{j}.convs2.{m}.bias"].copy_(c2.bias[keep])
    stw["conv_post.weight"].copy_(t["conv_post"].weight[:, streams[-1]])
    stw["conv_post.bias"].copy_(t["conv_post"].bias)


class SpectralLoss:
    """HiFi-GAN's full-band log-mel L1 plus multi-resolution STFT (spectral convergence and log
    magnitude) on `[B, samples]` fp32 waveforms."""

    def __init__(self, config: HifiGanConfig, device: torch.device):
        self.config = config
        self.basis = torch.from_numpy(
            mel_filterbank(config.sampling_rate, config.n_fft, config.num_mels, config.fmin, None)
        ).to(device)
        sizes = {config.n_fft, *(n for n, _ in STFT_RESOLUTIONS)}
        self.windows = {n: torch.hann_window(n, device=device) for n in sizes}

    def _mag(self, x: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
        spec = torch.stft(x, n_fft, hop, n_fft, self.windows[n_fft], return_complex=True)
        return torch.sqrt(spec.real.square() + spec.imag.square() + 1e-9)

    def log_mel(self, x: torch.Tensor) -> torch.Tensor:
        mag = self._mag(x, self.config.n_fft, self.config.hop_size)
        return torch.log(torch.clamp(self.basis @ mag, min=1e-5))

    def __call__(self, y: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = {"mel": F.l1_loss(self.log_mel(y), self.log_mel(target))}
        stft = y.new_zeros(())
        for n_fft, hop in STFT_RESOLUTIONS:
            a, b = self._mag(y, n_fft, hop), self._mag(target, n_fft, hop)
            stft = stft + torch.linalg.norm(b - a) / torch.linalg.norm(b).clamp(min=1e-6)
            stft = stft + F.l1_loss(torch.log(a), torch.log(b))
        parts["stft"] = stft / len(STFT_RESOLUTIONS)
        parts["wave"] = F.l1_loss(y, target)
        parts["total"] = (
            MEL_WEIGHT * parts["mel"] + STFT_WEIGHT * parts["stft"] + WAVE_WEIGHT * parts["wave"]
        )
        return parts


@torch.no_grad()
def held_out(student: Generator, loss: SpectralLoss, mels, targets) -> dict[str, float]:
    """Whole held-out utterances, offline, fp32: mel L1 and SNR against the teacher's audio."""
    student.eval()
    l1, signal, noise = 0.0, 0.0, 0.0
    for mel, target in zip(mels, targets):
        y = student(mel[None])[0, 0].float()
        l1 += F.l1_loss(loss.log_mel(y[None]), loss.log_mel(target[None])).item()
        signal += target.square().sum().item()
        noise += (y - target).square().sum().item()
    student.train()
    return {"mel_l1": l1 / len(mels), "snr_db": 10 * math.log10(signal / max(noise, 1e-12))}


def save_student(student: Generator, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (STUDENT + ".tmp")
    save_file(
        {k: v.detach().float().contiguous().cpu() for k, v in student.state_dict().items()},
        str(tmp),
    )
    os.replace(tmp, out / STUDENT)
    (out / "config.json").write_text(json.dumps(student.config.to_dict(), indent=1) + "\n")


class Crops:
    """Random training examples: `segment` frames of an utterance's mel with `context` frames on
    each side (so the student's output there is what offline synthesis gives), and the teacher's
    audio of the segment. At an utterance's edge the crop starts or ends there, as the teacher's
    input did; utterances shorter than a crop are left out."""

    def __init__(self, mels, targets, segment: int, context: int, hop: int, rng: random.Random):
        self.mels, self.targets, self.rng = mels, targets, rng
        self.segment, self.hop, self.window = segment, hop, segment + 2 * context
        self.context = context
        self.usable = [k for k, m in enumerate(mels) if m.shape[-1] >= self.window]
        if not self.usable:
            raise SystemExit(f"no utterance has the {self.window} frames a crop needs")
        self.weights = [mels[k].shape[-1] - segment for k in self.usable]

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(mel crops `[B, mels, window]`, teacher audio `[B, segment * hop]`, where each
        segment's audio starts in its crop's output)."""
        xs, ys, offsets = [], [], []
        for k in self.rng.choices(self.usable, weights=self.weights, k=size):
            frames = self.mels[k].shape[-1]
            s = self.rng.randrange(0, frames - self.segment + 1)
            w = min(max(s - self.context, 0), frames - self.window)
            xs.append(self.mels[k][:, w : w + self.window])
            ys.append(self.targets[k][s * self.hop : (s + self.segment) * self.hop])
            offsets.append((s - w) * self.hop)
        return torch.stack(xs), torch.stack(ys), offsets


def train(args: argparse.Namespace) -> None:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    teacher = load_teacher(args.data, device)
    decoder = load_token_decoder(args.voice / "vocoder")
    if decoder is None:
        raise SystemExit(f"{args.voice} has no token decoder")
    decoder = decoder.to(device)
    utterances = utterance_codes(args.data / CODES)
    rng.shuffle(utterances)
    mels, targets = [], []
    with torch.inference_mode():
        for codes in utterances[: args.limit]:
            mel = decoder(torch.from_numpy(codes).to(device)[None])[0]
            mels.append(mel)
            targets.append(teacher(mel[None])[0, 0])
    mels = [m.clone() for m in mels]
    targets = [t.clone() for t in targets]
    n_val = max(2, len(mels) // 100)
    val = (mels[:n_val], targets[:n_val])
    mels, targets = mels[n_val:], targets[n_val:]
    hop = teacher.hop_size
    _log(
        f"{len(mels)} training and {n_val} held-out utterances, "
        f"{sum(m.shape[-1] for m in mels) * hop / 22050 / 3600:.2f} h; teacher audio in "
        f"{time.perf_counter() - started:.0f} s"
    )

    config = student_config(teacher.config, args.width)
    if args.init is not None:  # carry on from an earlier run's student
        student = load_generator(resolve_checkpoint(args.init), device=device)
        if student.config != config:
            raise SystemExit(f"{args.init} is not a width-{args.width} student of this teacher")
    else:
        student = Generator(config).remove_weight_norm().to(device)
        prune_init(teacher, student, mels[:16])
    del teacher
    student.train()
    loss_fn = SpectralLoss(config, device)
    crops = Crops(mels, targets, args.segment, max(config.receptive_field) + 2, hop, rng)
    torch.backends.cudnn.benchmark = True  # every step has the same shapes (not so above)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.8, 0.99), weight_decay=0.0)
    discriminators: Discriminators | None = None
    opt_d: torch.optim.Optimizer | None = None
    budget = args.minutes * 60
    log = args.out / "log.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    params = sum(p.numel() for p in student.parameters()) / 1e6
    _log(f"width {args.width}: {params:.2f} M params")

    def checkpoint(**fields) -> None:
        """Held-out figures with `fields` as a line of the log; the student saved."""
        row = {**held_out(student, loss_fn, *val), **fields}
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        _log(f"width {args.width}: {row}")
        if fields["step"]:
            save_student(student, args.out)

    checkpoint(step=0, seconds=0.0)
    autocast = device.type == "cuda"
    t0, step, next_save = time.perf_counter(), 0, args.save_every
    running: dict[str, list[torch.Tensor]] = {}
    while (elapsed := time.perf_counter() - t0) < budget:
        lr = args.lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        for o in (opt, opt_d):  # cosine over the time budget
            for group in o.param_groups if o is not None else ():
                group["lr"] = lr
        x, target, offsets = crops.batch(args.batch)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = student(x)[:, 0]
        n = target.shape[-1]
        y = torch.stack([out[i, off : off + n] for i, off in enumerate(offsets)]).float()
        parts = loss_fn(y, target)
        total = parts["total"]
        if elapsed >= args.adversarial_from * budget:
            if discriminators is None:
                discriminators = Discriminators().to(device)
                opt_d = torch.optim.AdamW(
                    discriminators.parameters(), lr=lr, betas=(0.8, 0.99), weight_decay=0.0
                )
                _log(f"width {args.width}: adversarial stage from step {step}")
            assert opt_d is not None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                real_scores, real_maps = discriminators(target[:, None])
                fake_scores, _ = discriminators(y.detach()[:, None])
            parts["disc"] = discriminator_loss(real_scores, fake_scores)
            opt_d.zero_grad(set_to_none=True)
            parts["disc"].backward()
            opt_d.step()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                fake_scores, fake_maps = discriminators(y[:, None])
            parts["adv"] = generator_loss(fake_scores)
            parts["fm"] = feature_matching(real_maps, fake_maps)
            total = total + parts["adv"] + FM_WEIGHT * parts["fm"]
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 10.0)
        opt.step()
        step += 1
        for name, value in parts.items():
            running.setdefault(name, []).append(value.detach())
        if elapsed >= next_save or step == 1:
            train_means = {f"train_{k}": torch.stack(v).mean().item() for k, v in running.items()}
            checkpoint(step=step, seconds=round(elapsed, 1), lr=lr, **train_means)
            running = {}
            next_save += args.save_every
    checkpoint(step=step, seconds=round(time.perf_counter() - t0, 1), final=True)


# ---------------------------------------------------------------- export


def export(student: Path, voice: Path) -> None:
    """Put a trained student into the voice as its own generator (fp16 weights)."""
    from safetensors.torch import load_file, save_file

    checkpoint = resolve_checkpoint(student)
    load_generator(checkpoint)  # fails loudly when the weights do not fit the config
    target = voice / "vocoder"
    sd = load_file(str(checkpoint.path))
    save_file({k: v.half().contiguous() for k, v in sd.items()}, str(target / STUDENT))
    shutil.copyfile(student / "config.json", target / "config.json")
    _log(f"{checkpoint.path} -> {target / STUDENT}")


def main() -> None:
    from recipes.default_voice.config import RecipeConfig

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="teacher mels -> codes, and the teacher's weights")
    prep.add_argument("--cache", type=Path, default=RecipeConfig.cache)
    prep.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    prep.add_argument("--en", type=int, default=4000, help="English training sentences")
    prep.add_argument("--zh", type=int, default=1000, help="Mandarin training sentences")
    prep.add_argument("--workers", type=int, default=2)
    tr = sub.add_parser("train", help="distil a narrower generator")
    tr.add_argument("--data", type=Path, default=RecipeConfig.cache / "distill")
    tr.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    tr.add_argument("--out", type=Path, required=True)
    tr.add_argument("--width", type=int, default=256, help="upsample_initial_channel (V1: 512)")
    tr.add_argument("--minutes", type=float, default=7.0, help="training wall-clock budget")
    tr.add_argument("--batch", type=int, default=32)
    tr.add_argument("--segment", type=int, default=32, help="mel frames per example")
    tr.add_argument("--lr", type=float, default=5e-4)
    tr.add_argument("--seed", type=int, default=1234)
    tr.add_argument("--limit", type=int, default=None, help="use only this many utterances")
    tr.add_argument("--device", default=None)
    tr.add_argument(
        "--adversarial-from",
        type=float,
        default=0.25,
        help="fraction of the budget after which HiFi-GAN's discriminators join (1: never)",
    )
    tr.add_argument("--init", type=Path, default=None, help="start from this saved student")
    tr.add_argument("--save-every", type=float, default=60.0, help="seconds between checkpoints")
    ex = sub.add_parser("export", help="install a student as the voice's generator")
    ex.add_argument("--student", type=Path, required=True)
    ex.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    args = p.parse_args()
    if args.command == "prepare":
        prepare(args.cache, args.voice, args.en, args.zh, args.workers)
    elif args.command == "train":
        for flag in ("minutes", "batch", "segment", "lr", "save_every"):
            if getattr(args, flag) <= 0:
                p.error(f"--{flag.replace('_', '-')} must be positive")
        if not 0 <= args.adversarial_from <= 1:
            p.error("--adversarial-from must be a fraction of the budget, from 0 to 1")
        if not (args.data / TEACHER_CONFIG).is_file():
            p.error(f"--data {args.data} holds no teacher: run `prepare` first")
        try:  # a width the network cannot take, before any data is loaded
            student_config(HifiGanConfig.from_json(args.data / TEACHER_CONFIG), args.width)
        except ValueError as exc:
            p.error(f"--width: {exc}")
        train(args)
    else:
        export(args.student, args.voice)


if __name__ == "__main__":
    main()
