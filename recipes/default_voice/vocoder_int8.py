"""The vocoder in int8: its calibration (both runtimes'), and ONNX Runtime's offline score on
the voice.

    python -m recipes.default_voice.vocoder_int8 calibrate [--voice voices/default]
    python -m recipes.default_voice.vocoder_int8 score [--voice voices/default] [--count 100]

`calibrate` writes the voice's `vocoder/calibration_codes.npz`: the speech codes of the
teachers' audio of `--en` English and `--zh` Mandarin training sentences (never the held-out
ones), each cut to `--frames` mel frames. The vocoder service decodes them and calibrates its
int8 generator on them, torch's or ONNX Runtime's (`vocoder_service/quantize.py`, `--int8`).

`score` vocodes the natural held-out sentences offline on one thread through ONNX Runtime with
fp32, the service's int8 (the residual blocks of all but the last upsampling stage in int8) and int8 in every
stage's residual blocks, scored as
`vocoder_precision.py` scores (WER, DNSMOS, CPU s per audio s). The service's streamed int8 is
judged by `vocoder_precision.py --int8`. One JSON object on stdout (and
`<cache>/vocoder_int8.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from recipes.default_voice.config import RecipeConfig

ROOT = Path(__file__).resolve().parents[2]


def calibrate(
    voice: Path,
    en: int = 24,
    zh: int = 8,
    frames: int = 200,
    workers: int = 1,
    cache: Path | None = None,
) -> Path:
    """Write `voice/vocoder/calibration_codes.npz` from the teachers' training utterances (the
    recipe's sentence splits, under `cache`)."""
    from recipes.default_voice.distill import teacher_codes, training_items
    from vocoder_service.token_decoder import load_token_decoder
    from vocoder_service.voice import CALIBRATION_NAME

    decoder = load_token_decoder(voice / "vocoder")
    if decoder is None:
        raise SystemExit(f"{voice} has no token decoder")
    tokens = max(1, frames // decoder.config.frames_per_token)
    items = training_items(cache or RecipeConfig.cache, en, zh)
    codes, _ = teacher_codes(items, voice, workers)
    codes = [c[:tokens] for c in codes]
    out = voice / "vocoder" / CALIBRATION_NAME
    np.savez_compressed(
        out,
        codes=np.concatenate(codes).astype(np.int16),
        lengths=np.array([len(c) for c in codes], dtype=np.int32),
    )
    print(f"{len(codes)} utterances, {sum(map(len, codes))} codes -> {out}")
    return out


def score(voice_dir: Path, count: int) -> dict:
    """fp32, the service's int8 and int8 in every stage, offline, on the held-out set."""
    import torch

    from recipes.default_voice.vocoder_precision import held_out_mels, score as score_vocoders
    from vocoder_service.backends import OnnxBackend
    from vocoder_service.quantize import FP32_STAGES
    from vocoder_service.voice import load_voice

    torch.set_num_threads(1)
    voice = load_voice(voice_dir)
    calibration = voice.calibration_mels()
    with tempfile.TemporaryDirectory() as cache:
        options = dict(cache_dir=cache, intra_op_threads=1, allow_spinning=False)
        backends = {
            "fp32 (onnxruntime)": OnnxBackend(voice.generator, **options),
            f"int8, the service's (last {FP32_STAGES} stages fp32)": OnnxBackend(
                voice.generator, int8=True, calibration=calibration, **options
            ),
            "int8, every stage": OnnxBackend(
                voice.generator, int8=True, calibration=calibration, fp32_stages=0, **options
            ),
        }
        texts, mels = held_out_mels(voice_dir, count, RecipeConfig().seed)
        result = score_vocoders(
            {n: (lambda mel, b=b: b.run(mel).reshape(-1)) for n, b in backends.items()},
            texts,
            mels,
        )
    result["offline"] = True
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="write the voice's calibration codes")
    cal.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    cal.add_argument("--en", type=int, default=24, help="English training sentences")
    cal.add_argument("--zh", type=int, default=8, help="Mandarin training sentences")
    cal.add_argument("--frames", type=int, default=200, help="mel frames kept of each")
    cal.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    sc = sub.add_parser("score", help="fp32 against int8 offline on the held-out set")
    sc.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    sc.add_argument("--count", type=int, default=100, help="held-out sentences")
    args = p.parse_args()
    if args.command == "calibrate":
        for flag in ("en", "zh", "frames", "workers"):
            if getattr(args, flag) < (0 if flag in ("en", "zh") else 1):
                p.error(f"--{flag} must be >= {0 if flag in ('en', 'zh') else 1}")
        if args.en + args.zh < 1:
            p.error("--en and --zh must ask for at least one sentence")
        calibrate(args.voice, args.en, args.zh, args.frames, args.workers)
        return
    if args.count < 1:
        p.error("--count must be >= 1")
    result = score(args.voice, args.count)
    RecipeConfig.cache.mkdir(parents=True, exist_ok=True)
    (RecipeConfig.cache / "vocoder_int8.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
