"""Device selection shared by the services: auto = npu, then cuda, then cpu."""

from __future__ import annotations

import logging

import servicekit  # noqa: F401  (sets TORCH_DEVICE_BACKEND_AUTOLOAD before torch loads)

# isort: split
import torch

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "npu", "cuda", "cpu")


def npu_available() -> bool:
    """True when torch_npu imports and sees at least one NPU."""
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:
        log.debug("torch_npu unavailable: %s", exc)
        return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def select_device(name: str = "auto") -> torch.device:
    """Resolve a device name; an explicit device that is not present is an error."""
    name = name.lower()
    if name not in DEVICE_CHOICES and name.split(":")[0] not in DEVICE_CHOICES[1:]:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)} (got {name!r})")
    kind = name.split(":")[0]
    if kind == "auto":
        if npu_available():
            return torch.device("npu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if kind == "npu" and not npu_available():
        raise ValueError(
            "device 'npu' requested but torch_npu or an Ascend NPU is not available "
            "(install the 'npu' extra on a host with CANN)"
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def parse_dtype(name: str) -> torch.dtype:
    """Map 'float32' / 'fp16' / 'bfloat16' style names to torch dtypes."""
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(table)} (got {name!r})") from None
