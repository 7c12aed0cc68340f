"""The vocoder service: streamed speech tokens or mel frames -> audio with HiFi-GAN."""

import os

# Keep torch from auto-loading torch_npu on hosts without CANN (see servicekit.device).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
