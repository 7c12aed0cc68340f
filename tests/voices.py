"""Voice directories for tests: the real pretrained generator with a random token decoder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vocoder_service.token_decoder import (
    ConvLayer,
    TokenDecoder,
    TokenDecoderConfig,
    save_token_decoder,
)


def make_random_voice(
    root: Path,
    name: str = "testvoice",
    codebook_size: int = 64,
    frames_per_token: int = 2,
    lookahead: int = 2,
    seed: int = 0,
) -> Path:
    """A voice folder (voice.json + vocoder/token_decoder.*) on the universal HiFi-GAN."""
    torch.manual_seed(seed)
    config = TokenDecoderConfig(
        codebook_size=codebook_size,
        num_mels=80,
        frames_per_token=frames_per_token,
        channels=32,
        layers=(ConvLayer(3, 1), ConvLayer(3, lookahead - 1))
        if lookahead >= 2
        else (ConvLayer(3, lookahead),),
    )
    decoder = TokenDecoder(config)
    with torch.no_grad():  # log-mel-like values: speech sits around -6 .. 0
        decoder.codebook.copy_(torch.randn_like(decoder.codebook) * 1.5 - 4.0)
    folder = root / name
    save_token_decoder(decoder, folder / "vocoder")
    (folder / "voice.json").write_text(
        json.dumps(
            {
                "name": name,
                "languages": ["en-US"],
                "sample_rate": 22050,
                "hop_size": 256,
                "token_rate": 22050 / 256 / frames_per_token,
            }
        )
    )
    return folder


SPECIALS = ["<pad>", "<bos>", "<sep>", "<eos>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?'-")


def write_char_tokenizer(folder: Path, extra_tokens: int) -> dict[str, int]:
    """A character-level tokenizer.json: specials, characters, then `extra_tokens` speech ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    base = len(vocab)
    for i in range(extra_tokens):
        vocab[f"<s_{i}>"] = base + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(SPECIALS + [f"<s_{i}>" for i in range(extra_tokens)])
    tok.save(str(folder / "tokenizer.json"))
    return vocab


def make_tts_voice(
    root: Path,
    name: str = "tiny",
    speech_tokens: int = 64,
    max_tokens: int = 48,
    seed: int = 0,
    phoneme_sync: dict | None = None,
    lm_overrides: dict | None = None,
) -> Path:
    """A complete voice: tiny random Qwen3.5 LM with a char tokenizer + random token decoder;
    with `phoneme_sync`, decoded phoneme by phoneme (its characters are the "phonemes")."""
    from tests.hf_models import make_tiny_model

    folder = make_random_voice(root, name=name, codebook_size=speech_tokens, seed=seed)
    vocab_size = len(SPECIALS) + len(CHARS) + speech_tokens
    lm = make_tiny_model(
        root / f"{name}-lm-build",
        "qwen3_5",
        seed=seed,
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=3,
        pad_token_id=0,
        **(lm_overrides or {}),
    )
    lm.rename(folder / "lm")
    write_char_tokenizer(folder / "lm", speech_tokens)
    start = len(SPECIALS) + len(CHARS)
    if phoneme_sync and phoneme_sync.get("durations") == "random":
        phoneme_sync = {**phoneme_sync, "durations": write_random_duration_predictor(folder, start)}
    (folder / "voice.json").write_text(
        json.dumps(
            {
                "name": name,
                "description": "tiny random test voice",
                "languages": ["en-US", "cmn-CN"],
                "sample_rate": 22050,
                "hop_size": 256,
                "frames_per_token": 2,
                "token_rate": 43.07,
                "speech_token_range": [start, start + speech_tokens - 1],
                "end_token_id": 3,
                "prompt_template": "<bos>{text}<sep>",
                "text_frontend": {"en-US": {"g2p": "none"}, "cmn-CN": {"g2p": "none"}},
                "sampling": {"temperature": 0.0},
                "max_tokens": max_tokens,
                **({"phoneme_sync": phoneme_sync} if phoneme_sync else {}),
            }
        )
    )
    return folder


def write_random_duration_predictor(
    folder: Path, vocab: int, mean_tokens: float = 2.0, seed: int = 0
) -> str:
    """Weights in orchestrator.durations' format whose predictions sit around `mean_tokens`."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    c = 8
    weights = {
        "embedding": rng.normal(0, 0.3, (vocab, c)).astype(np.float32),
        "convs.0.weight": rng.normal(0, 0.2, (c, c, 3)).astype(np.float32),
        "convs.0.bias": np.zeros(c, np.float32),
        "proj.weight": rng.normal(0, 0.1, (1, c)).astype(np.float32),
        "proj.bias": np.array([np.log1p(mean_tokens)], np.float32),
    }
    (folder / "durations").mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "durations" / "predictor.safetensors"))
    return "durations/predictor.safetensors"


def speech_tokens_only(folder: Path) -> Path:
    """Make the voice's (greedy) LM never end: every call then runs to max_tokens.

    The end token stays allowed (stop ids always are), so its output row is zeroed: its logit is
    0, below the largest of 64 random speech-token logits at every step.
    """
    from safetensors.numpy import load_file, save_file

    manifest = json.loads((folder / "voice.json").read_text())
    weights_file = folder / "lm" / "model.safetensors"
    weights = load_file(str(weights_file))
    key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[key][manifest["end_token_id"]] = 0.0
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return folder
