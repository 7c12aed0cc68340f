"""Cache pools on the CPU: zeroed, and on transparent huge pages where Linux grants them."""

import sys
from pathlib import Path

import pytest
import torch

from text_service.models import cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages summed over the mappings that overlap `tensor`'s bytes (/proc/self/smaps;
    madvise splits a mapping where the advised range starts and ends)."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low < end and start < high
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages here",
)
def test_a_cpu_pool_is_zeroed_and_on_huge_pages() -> None:
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so fresh pages that no earlier
    # test has touched (a smaller pool may reuse heap memory already on 4 KiB pages)
    pool = cache.zeros_in_huge_pages((2048, 16, 8, 128), torch.bfloat16, "cpu")
    assert pool.shape == (2048, 16, 8, 128) and pool.dtype == torch.bfloat16
    assert not pool.any()
    # the 2 MiB-aligned interior asked for huge pages before its first write
    assert huge_page_bytes(pool) >= 32 << 20


def test_without_madvise_a_pool_is_still_zeroed(monkeypatch) -> None:
    monkeypatch.setattr(cache, "_madvise", lambda: None)
    pool = cache.zeros_in_huge_pages((3, 5), torch.float32, "cpu")
    assert pool.shape == (3, 5) and not pool.any()
    assert cache.zeros_in_huge_pages((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)
