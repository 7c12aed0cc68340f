"""Pieces every split-tts service shares: server start-up, device selection, logging."""

import os

# torch auto-loads installed device backends on import; torch_npu then fails on hosts without
# CANN. Turn that off before anything imports torch; device.py imports torch_npu explicitly.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
