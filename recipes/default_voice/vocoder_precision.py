"""Judge a cheaper vocoder by what listeners get, not by SNR: the bundled voice's WER and DNSMOS
on the natural held-out English set (Debian `fortunes`, a source the training never reads),
with the same speech codes vocoded by each generator precision, side by side.

    python -m recipes.default_voice.vocoder_precision [--voice voices/default] [--count 100]
        [--compare-universal] [--int8] [--runtime onnxruntime|torch]

Each sentence goes through the deployed decoding once (espeak-ng phonemes, the voice's LM with
its phoneme-synchronous plan, greedy); its codes go through the voice's token decoder once; only
the generator differs: ONNX Runtime fp32 and torch bf16 (`--bf16 --backend torch`) and, with
`--int8`, int8 calibrated on the voice's calibration codes through ONNX Runtime (fp32 elsewhere)
and through torch's oneDNN (bf16 elsewhere), each streamed chunk by chunk as the service runs it
on a CPU. `--runtime` keeps one runtime's generators (a CPU without oneDNN's bf16 runs only
ONNX Runtime's). Also printed: each generator's CPU seconds per audio second on one thread,
measured in the same run, rotating which goes first. With `--compare-universal` the pretrained
universal V1 runs beside the voice's own generator in both precisions (how a distilled
generator, `distill.py`, is judged).
One JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.data import ESPEAK_VOICES, espeak_phonemes
from recipes.default_voice.evaluate import to16k
from recipes.default_voice.lm import split_stream
from recipes.default_voice.metrics import Recognizer, dnsmos, word_errors, write_arpa
from recipes.default_voice.natural import english_held_out
from recipes.default_voice.synth import CANDIDATES, decode

ROOT = Path(__file__).resolve().parents[2]
DEPLOYED = "vote, cap 8, at least half the predicted duration"


def _log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


RUNTIMES = ("onnxruntime", "torch")


def generators(
    voice_dir: Path,
    compare_universal: bool = False,
    int8: bool = False,
    runtimes: tuple[str, ...] = RUNTIMES,
) -> dict:
    from vocoder_service.backends import OnnxBackend, TorchBackend
    from vocoder_service.checkpoint import resolve_checkpoint
    from vocoder_service.voice import load_voice

    voice = load_voice(voice_dir)
    checkpoints = {"": voice.generator}
    if compare_universal:
        universal = resolve_checkpoint()
        if universal.fingerprint == voice.generator.fingerprint:
            raise SystemExit(f"{voice_dir} uses the universal generator already")
        checkpoints = {"voice's own, ": voice.generator, "universal V1, ": universal}
    tools: dict = {"voice": voice}
    for prefix, checkpoint in checkpoints.items():
        if "onnxruntime" in runtimes:
            tools[f"{prefix}fp32 (onnxruntime)"] = OnnxBackend(checkpoint, intra_op_threads=1)
        if "torch" in runtimes:
            tools[f"{prefix}bf16 (torch, oneDNN)"] = TorchBackend(checkpoint, bf16=True)
        if int8 and "onnxruntime" in runtimes:
            tools[f"{prefix}int8 (onnxruntime)"] = OnnxBackend(
                checkpoint, intra_op_threads=1, int8=True, calibration=voice.calibration_mels()
            )
        if int8 and "torch" in runtimes:
            tools[f"{prefix}int8 (torch, oneDNN; bf16 elsewhere)"] = TorchBackend(
                checkpoint, bf16=True, int8=True, calibration=voice.calibration_mels()
            )
    for name, backend in tools.items():
        if name != "voice":  # export (and quantise) the streaming graphs before any timing
            backend.warmup(stateful=True)
    return tools


def streamed(backend, mel: np.ndarray, chunk: int = 32) -> np.ndarray:
    """The service's CPU path: the stateful generator, a first chunk just long enough to get
    through every layer, then `chunk` frames a call, then the final call."""
    sizes = [backend.receptive_field[1] + 1]
    while sum(sizes) < mel.shape[-1]:
        sizes.append(chunk)
    state, pieces, start = None, [], 0
    for n in sizes:
        part = np.ascontiguousarray(mel[:, :, start : start + n])
        start += n
        audio, state = backend.run_stream(part, state, final=start >= mel.shape[-1])
        pieces.append(audio)
    return np.concatenate(pieces)


def held_out_mels(voice_dir: Path, count: int, seed: int) -> tuple[list[str], list[np.ndarray]]:
    """The natural held-out sentences and the mels the service would vocode for them: the
    deployed decoding once (espeak-ng phonemes, the voice's LM, greedy), then the voice's token
    decoder. Mels are `[1, num_mels, frames]` float32."""
    from vocoder_service.token_decoder import load_token_decoder

    cfg = dataclasses.replace(RecipeConfig(), threads=1)
    texts = english_held_out(count, seed=seed)
    phonemes = [espeak_phonemes(t, ESPEAK_VOICES["en"]) for t in texts]
    decoding = next(c for c in CANDIDATES if c.name == DEPLOYED)
    started = time.perf_counter()
    streams = decode(
        cfg,
        voice_dir / "lm",
        phonemes,
        decoding,
        predictor=voice_dir / "durations" / "duration_predictor.safetensors",
    )
    _log(f"decoded {len(texts)} sentences in {time.perf_counter() - started:.0f} s")
    decoder = load_token_decoder(voice_dir / "vocoder")
    if decoder is None:
        raise SystemExit(f"{voice_dir} has no token decoder")
    mels = []
    for stream in streams:
        codes = split_stream(stream)[1] or [0, 0]
        mels.append(decoder.decode(np.asarray(codes, dtype=np.int64))[None].astype(np.float32))
    return texts, mels


def score(
    vocoders: dict[str, Callable[[np.ndarray], np.ndarray]],
    texts: list[str],
    mels: list[np.ndarray],
) -> dict:
    """Each vocoder (mel -> waveform) on every sentence, in rotating order: WER, mean DNSMOS and
    its CPU seconds per audio second."""
    audio_s = sum(m.shape[-1] for m in mels) * 256 / 22050
    with tempfile.TemporaryDirectory() as tmp:
        arpa = Path(tmp) / "held_out.arpa"
        write_arpa(texts, arpa)
        asr = Recognizer(arpa)
        rows: dict[str, dict] = {
            name: {"cpu_s": 0.0, "errors": 0, "words": 0, "dnsmos": []} for name in vocoders
        }
        for k, (text, mel) in enumerate(zip(texts, mels)):
            order = list(vocoders)[k % len(vocoders) :] + list(vocoders)[: k % len(vocoders)]
            for name in order:
                cpu = time.process_time()
                wav = vocoders[name](mel)
                rows[name]["cpu_s"] += time.process_time() - cpu
                a16 = to16k(wav)
                errors, words = word_errors(text, asr(a16))
                rows[name]["errors"] += errors
                rows[name]["words"] += words
                rows[name]["dnsmos"].append(dnsmos(a16))
            if (k + 1) % 20 == 0:
                _log(f"{k + 1}/{len(texts)} scored")
    return {
        "set": "en_natural (Debian fortunes)",
        "sentences": len(texts),
        "audio_s": round(audio_s, 1),
        "decoding": DEPLOYED,
        "pressure_cpu": Path("/proc/pressure/cpu").read_text().splitlines()[0],
        "generators": {
            name: {
                "wer": r["errors"] / max(1, r["words"]),
                "dnsmos": float(np.mean(r["dnsmos"])),
                "cpu_s_per_audio_s": r["cpu_s"] / audio_s,
            }
            for name, r in rows.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    p.add_argument("--count", type=int, default=100, help="held-out sentences")
    p.add_argument(
        "--compare-universal",
        action="store_true",
        help="also run the pretrained universal V1 (for a voice with its own generator)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="also run ONNX Runtime int8, calibrated on the voice's calibration codes",
    )
    p.add_argument(
        "--runtime",
        choices=RUNTIMES,
        action="append",
        help="only this runtime's generators (repeatable; default both): torch's need oneDNN's "
        "bf16, which a CPU with AVX2 alone lacks",
    )
    args = p.parse_args()
    if args.count < 1:
        p.error("--count must be >= 1")

    import torch

    from servicekit.memory import retain_freed_memory

    torch.set_num_threads(1)
    retain_freed_memory()
    cfg = RecipeConfig()
    texts, mels = held_out_mels(args.voice, args.count, cfg.seed)
    runtimes = tuple(args.runtime or RUNTIMES)
    tools = generators(args.voice, args.compare_universal, args.int8, runtimes)
    tools.pop("voice")
    result = score({n: partial(streamed, b) for n, b in tools.items()}, texts, mels)
    cfg.cache.mkdir(parents=True, exist_ok=True)  # the voice card's table (bundle.py)
    name = "vocoder_distilled" if args.compare_universal else "vocoder_precision"
    if runtimes != RUNTIMES:  # a partial table is not the voice card's
        name += "_" + "_".join(runtimes)
    name += ".json"
    (cfg.cache / name).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
