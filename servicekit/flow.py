"""Flow control for one stream: how much a producer may run ahead of its reader."""

from __future__ import annotations

import asyncio


class AheadBudget:
    """Counts units (samples, tokens) made but not yet taken by the reader.

    A producer awaits `room()` before making more; the reader calls `taken(n)`. The first unit
    is always allowed, so one item larger than the bound still flows.
    """

    def __init__(self, limit: float):
        if limit <= 0:
            raise ValueError(f"the bound must be > 0 (got {limit})")
        self.limit = limit
        self.ahead = 0.0
        self.peak = 0.0  # the most ever ahead, for logs and tests
        self._taken = asyncio.Event()

    async def room(self) -> None:
        """Wait until less than `limit` is ahead."""
        while self.ahead >= self.limit:
            self._taken.clear()
            await self._taken.wait()

    def add(self, n: float) -> None:
        self.ahead += n
        self.peak = max(self.peak, self.ahead)

    def taken(self, n: float) -> None:
        self.ahead -= n
        self._taken.set()
