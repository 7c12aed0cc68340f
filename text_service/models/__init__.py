"""Model classes by HF ``model_type`` and construction on a device."""

from collections.abc import Callable
from contextlib import contextmanager

import torch

from text_service.models.base import CausalLM
from text_service.models.qwen3 import Qwen3ForCausalLM
from text_service.models.qwen3_5 import Qwen3_5ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def get_model_class(config) -> Callable[..., CausalLM]:
    """The class implementing ``config.model_type``; raises ValueError for unsupported types."""
    try:
        return MODEL_REGISTRY[config.model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {config.model_type!r}: expected one of {sorted(MODEL_REGISTRY)}"
        ) from None


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
) -> CausalLM:
    """An unloaded model (parameters uninitialised) created directly on ``device`` in ``dtype``."""
    device = torch.device(device)
    with torch.device(device), _default_dtype(dtype):
        model = get_model_class(config)(config, device=device, max_positions=max_positions)
    return model.eval()


__all__ = [
    "MODEL_REGISTRY",
    "CausalLM",
    "Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "build_model",
    "get_model_class",
]
