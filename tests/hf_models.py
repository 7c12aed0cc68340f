"""Tiny random HF Qwen3.5 / Qwen3 checkpoints written with ``save_pretrained`` for tests."""

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_DEFAULTS = {
    "qwen3_5": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        tie_word_embeddings=True,
        initializer_range=0.1,
    ),
    "qwen3": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.1,
    ),
}
_CLASSES = {
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_config(kind: str = "qwen3_5", **overrides):
    """A small HF config of ``kind`` ("qwen3_5" or "qwen3"); overrides replace defaults."""
    if kind not in _CLASSES:
        raise ValueError(f"unknown kind {kind!r}: expected one of {sorted(_CLASSES)}")
    kwargs = {**TINY_DEFAULTS[kind], **overrides}
    if "layer_types" in overrides and "num_hidden_layers" not in overrides:
        kwargs["num_hidden_layers"] = len(overrides["layer_types"])
    if kind == "qwen3_5" and "num_hidden_layers" in overrides and "layer_types" not in overrides:
        kwargs.pop("layer_types")
    return _CLASSES[kind][0](**kwargs)


def _randomize(model: PreTrainedModel, seed: int) -> None:
    # HF initialises norm weights to their identity values and dt_bias to ones, which would hide
    # a wrong norm offset or a dropped bias; perturb them so every parameter matters.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                param.add_(0.3 * torch.randn(param.shape, generator=gen))


# Every projection holds >= 2^20 weights (and its dims are multiples of 32), so the CPU path
# packs it: for oneDNN in fp32, in AMX's tile order in bf16 where the CPU has it.
WIDE = {
    "dense": (
        "qwen3",
        dict(
            vocab_size=1024,
            hidden_size=1024,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=False,
        ),
    ),
    "hybrid": (
        "qwen3_5",
        dict(
            vocab_size=1024,
            hidden_size=1024,
            intermediate_size=1024,
            layer_types=["linear_attention", "full_attention"],
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
}


def make_tiny_model(
    tmp_path: str | Path,
    kind: str = "qwen3_5",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Save a tiny random fp32 HF model of ``kind`` under ``tmp_path`` and return its directory."""
    config = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = _CLASSES[kind][1](config).float().eval()
    _randomize(model, seed)
    out = Path(tmp_path) / f"{kind}-{seed}"
    if max_shard_size is None:
        model.save_pretrained(out)
    else:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def load_hf_model(model_dir: str | Path) -> PreTrainedModel:
    """The HF reference model of a directory written by ``make_tiny_model`` (fp32, eval)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] of one no-cache full-sequence forward."""
    out = model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()
