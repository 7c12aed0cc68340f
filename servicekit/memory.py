"""Host memory settings for CPU inference processes."""

import ctypes
import ctypes.util


def retain_freed_memory() -> bool:
    """Let glibc keep large freed blocks for reuse instead of returning them to the OS.

    By default glibc maps every block over its dynamic threshold (at most 32 MiB) afresh and
    unmaps it on free, and trims the heap's top, so large tensors fault their pages in again on
    every use: 10% of a text-service prefill step (a 2048-token MLP output is 38 MB in fp32),
    and torch eager HiFi-GAN ran 1.2-1.4x slower for it on the project's CPU. The process
    keeps its peak heap instead. Returns False where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 1 << 30))


# Compiled oneDNN primitives the process keeps (oneDNN's default is 1024).
ONEDNN_PRIMITIVES = 16384


def keep_onednn_primitives(capacity: int = ONEDNN_PRIMITIVES) -> None:
    """Let oneDNN keep `capacity` compiled primitives instead of 1024; an operator's
    `ONEDNN_PRIMITIVE_CACHE_CAPACITY` wins. Call before the first oneDNN operation.

    A primitive is compiled per layer and input shape. A streaming vocoder meets a new chunk
    width on most calls (about 80 convolutions each), and the text engine a new row count on
    most steps, so 1024 thrash: on the project's CPU a bf16 HiFi-GAN streamed in chunks of 2-24
    frames spent 0.29 CPU s per audio s with the default and 0.245 with the larger cache, as
    much as in fixed-width chunks. A primitive holds a few KiB of code and descriptors.
    """
    import os

    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
