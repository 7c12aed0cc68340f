"""Model kernels behind one table of callables, chosen once per device type (torch only)."""

from kernels.ops import Ops, get_ops
from kernels.rotary import rope_cache

__all__ = ["Ops", "get_ops", "rope_cache"]
