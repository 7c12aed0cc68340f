"""The deployed decoding, offline: phoneme strings through the project's engine to speech codes.

Each candidate decoding is what the orchestrator would send for a voice manifest: the free
copy of the old bundles (only the allowed range), or phoneme-synchronous decoding with a cap,
a band around predicted durations, or the predicted schedule forced; the teacher's own
durations forced are an oracle for reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator.phoneme_sync import SyncPlanner
from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.lm import (
    CHAR_BASE,
    EOS,
    PROMPT_TEMPLATE,
    SPEECH_START,
    max_new_tokens,
    prompt_ids,
)


@dataclass(frozen=True)
class Decoding:
    """One way to decode; `band` None with `sync` is the cap alone (the model's vote decides)."""

    name: str
    sync: bool = True
    band: tuple[float, float] | None = None
    cap: int = 8
    oracle: bool = False  # the teacher's own durations forced

    def manifest_entry(self) -> dict | None:
        """The voice.json `phoneme_sync` entry that deploys this decoding."""
        if not self.sync or self.oracle:
            return None
        entry: dict = {"max_tokens_per_phoneme": self.cap}
        if self.band is not None:
            entry.update(durations="durations/duration_predictor.safetensors", band=list(self.band))
        return entry


CANDIDATES = (
    Decoding("free copy", sync=False),
    Decoding("vote, cap 8"),
    Decoding("vote, cap 4", cap=4),
    Decoding("predicted durations, band 0.7-1.4", band=(0.7, 1.4), cap=24),
    Decoding("vote, cap 8, at least half the predicted duration", band=(0.5, 100.0)),
    Decoding("predicted durations forced", band=(1.0, 1.0), cap=24),
    Decoding("teacher durations forced (oracle)", oracle=True, cap=64),
)


def decode(
    cfg: RecipeConfig,
    lm_dir: Path,
    phonemes: list[str],
    decoding: Decoding,
    teacher_durations: list[np.ndarray] | None = None,
    temperature: float = 0.0,
    top_k: int = 50,
    predictor: Path | None = None,
) -> list[list[int]]:
    """Output ids of each phoneme string (the end id included when it stopped)."""
    import torch

    from text_service.constraints import PhonemeSync
    from text_service.engine import EngineArgs, LLMEngine
    from text_service.sampling_params import SamplingParams

    torch.set_num_threads(cfg.threads)
    engine = LLMEngine(
        EngineArgs(
            model=str(lm_dir),
            device="cpu",
            max_num_seqs=64,
            kv_cache_memory_bytes=1 << 29,
            seed=cfg.seed,
        )
    )
    speech = (SPEECH_START, SPEECH_START + cfg.codebook_size - 1)
    planner = None
    if decoding.sync:
        band = decoding.band if decoding.band is not None else (1.0, 1.0)
        path = predictor if decoding.band is not None else None
        planner = SyncPlanner(lm_dir / "tokenizer.json", PROMPT_TEMPLATE, decoding.cap, band, path)
    prompts, params = [], []
    for k, text in enumerate(phonemes):
        base = dict(
            temperature=temperature, top_k=top_k if temperature > 0 else 0, seed=cfg.seed + k
        )
        if planner is None:
            prompts.append(prompt_ids(text))
            params.append(
                SamplingParams(
                    max_tokens=max_new_tokens(text, cfg),
                    stop_token_ids=(EOS,),
                    allowed_token_range=(CHAR_BASE, speech[1]),
                    **base,
                )
            )
            continue
        plan = planner.plan(text)
        lo, hi = plan.min_tokens, plan.max_tokens
        if decoding.oracle and len(teacher_durations[k]) == len(lo):
            lo = hi = [
                int(d) for d in teacher_durations[k]
            ]  # else the tokenizer dropped a character
        c = PhonemeSync(tuple(plan.phoneme_ids), speech, EOS, tuple(lo), tuple(hi))
        prompts.append(plan.prompt_ids)
        params.append(
            SamplingParams(
                max_tokens=min(cfg.max_tokens * 2, len(lo) + sum(hi) + 1), phoneme_sync=c, **base
            )
        )
    return engine.generate(prompts, params)
