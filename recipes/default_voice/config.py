"""Every knob of the default-voice recipe in one read-only dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RecipeConfig:
    """Sizes, seeds and paths; defaults fit about 2.5 hours on a 2-core CPU."""

    cache: Path = Path.home() / ".cache" / "split-tts" / "default_voice"
    out: Path = Path("voices/default")
    seed: int = 1234
    # a voice bundle to start from: its codebook and token decoder are kept (so the vocoder side
    # is unchanged) and its LM is fine-tuned instead of trained from nothing
    init_from: Path | None = None
    workers: int = 2
    en_train_natural: int = 4000  # the last 100 are the validation slice
    en_train_templates: int = 1500  # numbers, money and questions
    en_eval: int = 200  # per held-out set: templates and natural
    zh_train_natural: int = 820  # the last 40 are the validation slice
    zh_train_templates: int = 700
    zh_eval: int = 200
    frames_per_token: int = 2
    codebook_size: int = 1024
    kmeans_frames: int = 100_000
    kmeans_iters: int = 15
    decoder_channels: int = 192
    decoder_layers: tuple[tuple[int, int], ...] = (
        (5, 2),
        (5, 2),
        (3, 0),
        (3, 0),
    )  # (kernel, lookahead)
    decoder_steps: int = 1500
    hidden_size: int = 192
    num_layers: int = 4
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention") * 2
    dropout: float = 0.1
    lm_minutes: float = 92.0
    lm_batch_tokens: int = 4000
    lm_lr: float = 2e-3
    lm_finetune_lr: float = 7e-4
    eval_minutes: float = 12.0
    threads: int = 1
    max_tokens: int = 1200
    temperature: float = 0.0  # greedy copied the phonemes best on validation (see the voice card)
    top_k: int = 50
