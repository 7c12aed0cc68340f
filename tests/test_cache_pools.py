"""Cache pools on the CPU: zeroed, and on transparent huge pages where Linux grants them."""

import sys
from pathlib import Path

import pytest
import torch

from text_service.models import cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mappings(start: int, end: int) -> list[dict]:
    """The /proc/self/smaps entries of the mappings that overlap [start, end): their bounds, VmFlags
    and AnonHugePages (madvise splits a mapping where the advised range starts and ends)."""
    found: list[dict] = []
    current: dict | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            current = {"low": low, "high": high} if low < end and start < high else None
            if current is not None:
                found.append(current)
        elif current is not None and head == "VmFlags:":
            current["flags"] = line.split()[1:]
        elif current is not None and head == "AnonHugePages:":
            current["huge_bytes"] = int(line.split()[1]) * 1024
    return found


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages here",
)
def test_a_cpu_pool_is_zeroed_and_advised_as_huge_pages() -> None:
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so a fresh mapping of its own
    pool = cache.zeros_in_huge_pages((2048, 16, 8, 128), torch.bfloat16, "cpu")
    assert pool.shape == (2048, 16, 8, 128) and pool.dtype == torch.bfloat16
    assert not pool.any()
    # the 2 MiB-aligned interior carries the advice ("hg"); how much of it Linux backs with
    # huge pages depends on how fragmented memory is (22-64 MiB in our runs), so only the advice
    # and some huge pages are asserted
    huge = 2 << 20
    start = (pool.data_ptr() + huge - 1) // huge * huge
    end = (pool.data_ptr() + pool.nbytes) // huge * huge
    interior = mappings(start, end)
    assert interior and all("hg" in m["flags"] for m in interior)
    assert interior[0]["low"] <= start and interior[-1]["high"] >= end
    assert (
        sum(m["huge_bytes"] for m in mappings(pool.data_ptr(), pool.data_ptr() + pool.nbytes)) > 0
    )


def test_without_madvise_a_pool_is_still_zeroed(monkeypatch) -> None:
    monkeypatch.setattr(cache, "_madvise", lambda: None)
    pool = cache.zeros_in_huge_pages((3, 5), torch.float32, "cpu")
    assert pool.shape == (3, 5) and not pool.any()
    assert cache.zeros_in_huge_pages((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)
