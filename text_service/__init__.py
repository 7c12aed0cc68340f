"""The text service: a paged-attention engine serving Qwen3.5 / Qwen3 speech LMs over gRPC."""

import os

# Keep torch from auto-loading torch_npu on hosts without CANN (see servicekit.device).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
