"""`python -m recipes.default_voice [--steps data,tokens,decoder,lm,eval,bundle] [--cache DIR]`."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from recipes.default_voice.config import RecipeConfig

STEPS = ("data", "tokens", "decoder", "durations", "teacher_eval", "lm", "eval", "bundle")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--steps", default=",".join(STEPS), help="comma-separated subset of " + ",".join(STEPS)
    )
    parser.add_argument(
        "--cache", type=Path, default=RecipeConfig.cache, help="checkpoint directory (resumable)"
    )
    parser.add_argument("--out", type=Path, default=RecipeConfig.out, help="voice bundle directory")
    parser.add_argument("--lm-minutes", type=float, default=RecipeConfig.lm_minutes)
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="voice bundle whose codebook and decoder are kept and whose LM is fine-tuned",
    )
    args = parser.parse_args()
    cfg = dataclasses.replace(
        RecipeConfig(),
        cache=args.cache,
        out=args.out,
        lm_minutes=args.lm_minutes,
        init_from=args.init_from,
    )
    cfg.cache.mkdir(parents=True, exist_ok=True)
    for step in args.steps.split(","):
        if step not in STEPS:
            raise SystemExit(f"unknown step {step!r}; choose from {', '.join(STEPS)}")
        t0 = time.time()
        print(f"== {step}", flush=True)
        if step == "data":
            from recipes.default_voice.data import build_teacher_data

            build_teacher_data(cfg)
        elif step == "tokens":
            from recipes.default_voice.tokens import build_codebook

            build_codebook(cfg)
        elif step == "decoder":
            from recipes.default_voice.tokens import train_decoder

            train_decoder(cfg)
        elif step == "durations":
            from recipes.default_voice.durations import train_durations

            train_durations(cfg)
        elif step == "teacher_eval":
            from recipes.default_voice.evaluate import teacher_scores

            teacher_scores(cfg)
        elif step == "lm":
            from recipes.default_voice.lm import train_lm

            train_lm(cfg)
        elif step == "eval":
            from recipes.default_voice.evaluate import evaluate

            evaluate(cfg)
        elif step == "bundle":
            from recipes.default_voice.bundle import write_bundle

            write_bundle(cfg)
        print(f"== {step} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
