"""Paged KV blocks with prefix caching, and linear-attention state slots for hybrid models."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple

from text_service.config import EngineConfig
from text_service.sequence import Sequence

_ROOT_HASH = 0x5EED_0F_CAC4E  # parent hash of a sequence's first block


class StateCopy(NamedTuple):
    """Copy every linear-attention layer's state (conv and recurrent) from slot src to dst."""

    src: int
    dst: int


class Block:
    """One KV block of `block_size` token positions, shared by reference count."""

    __slots__ = ("block_id", "ref_count", "hash", "key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set once the block is full and its KV computed
        self.key: tuple[int, tuple[int, ...]] | None = None  # (parent hash, tokens) behind hash


class StateSlotPool:
    """Live state slots `[0, num_slots)`: one per admitted sequence of a hybrid model."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (its old contents are garbage: the first chunk starts from zeros)."""
        if not self._free:
            raise RuntimeError("no free state slot: check num_free before allocate")
        return self._free.popleft()

    def free(self, slot: int) -> None:
        """Return a slot taken by allocate."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"state slot {slot} is not allocated")
        self._free.append(slot)


class BlockManager:
    """Counts KV blocks (for the full-attention layers) and state slots (for the linear ones).

    Prefix caching: a block becomes reusable once it is full and its KV has been computed; it is
    keyed by the chained hash of (parent hash, its token ids). Freed blocks keep their hash and
    are evicted least-recently-freed first. On hybrid models a hit also needs the recurrent
    state at the hit boundary, so hits stop at the last block with a snapshot: snapshot slots
    are numbered after the live slots, bound to a block hash, and dropped with that block or in
    LRU order when slots run out.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        num_state_slots: int = 0,
        num_snapshot_slots: int = 0,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id of the block that serves hits
        self.state_slots = StateSlotPool(num_state_slots)
        self.is_hybrid = num_state_slots > 0
        self.num_snapshot_slots = num_snapshot_slots if self.is_hybrid else 0
        first = num_state_slots  # snapshot slots follow the live ones in the same tensors
        self._free_snapshots = list(range(first, first + self.num_snapshot_slots))
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU first
        self._pending: dict[object, tuple[int, int]] = {}  # seq id -> (hash, slot) until commit
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found in the cache

    @classmethod
    def from_config(cls, config: EngineConfig) -> BlockManager:
        return cls(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.num_state_slots,
            config.num_snapshot_slots,
        )

    # -- views --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_free_snapshot_slots(self) -> int:
        return len(self._free_snapshots)

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by sequences."""
        return 1.0 - len(self._free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ----------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of the first `num_blocks` full blocks (memoised on the sequence)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash((parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))))
        return hashes

    def _key(self, seq: Sequence, i: int) -> tuple[int, tuple[int, ...]]:
        parent = seq.block_hashes[i - 1] if i else _ROOT_HASH
        return parent, tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _lookup(self, seq: Sequence) -> tuple[list[int], int | None]:
        """Cached block ids of the longest usable prefix and, on hybrids, its snapshot slot."""
        if not self.enable_prefix_caching:
            return [], None
        # The last token is always computed: its logits give the next token.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        usable, snapshot = 0, None
        for i, h in enumerate(self._hashes(seq, max_blocks)[:max_blocks]):
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].key != self._key(seq, i):
                break  # a miss, or a hash collision
            hit.append(block_id)
            if not self.is_hybrid:
                usable = len(hit)
            elif h in self._snapshots:
                usable, snapshot = len(hit), self._snapshots[h]
        return hit[:usable], snapshot

    def _free_blocks_needed(self, seq: Sequence, hit: list[int]) -> int:
        revived = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        return self.blocks_needed(seq.num_tokens) - len(hit) + revived

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `seq` can be admitted now: blocks for all its tokens, a state slot if hybrid."""
        if self.is_hybrid and self.state_slots.num_free == 0:
            return False
        hit, _ = self._lookup(seq)
        return len(self._free) >= self._free_blocks_needed(seq, hit)

    def allocate(self, seq: Sequence) -> StateCopy | None:
        """Admit `seq`: fill its block table (reusing cached blocks) and take a state slot.

        Sets `seq.num_cached_tokens`. Returns the snapshot -> live-slot copy a hybrid prefix hit
        needs before the step, else None.
        """
        if seq.block_table or seq.state_slot >= 0:
            raise RuntimeError(f"sequence {seq.seq_id!r} already holds cache resources")
        if not self.can_allocate(seq):
            raise RuntimeError("allocate() called when can_allocate() is False")
        hit, snapshot = self._lookup(seq)
        for block_id in hit:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = hit + [
            self._take_free_block() for _ in range(self.blocks_needed(seq.num_tokens) - len(hit))
        ]
        seq.num_cached_tokens = len(hit) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens
        if not self.is_hybrid:
            return None
        seq.state_slot = self.state_slots.allocate()
        if snapshot is None:
            return None
        self._snapshots.move_to_end(seq.block_hashes[len(hit) - 1])
        return StateCopy(snapshot, seq.state_slot)

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self._forget(block)
        block.ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self._cached.get(block.hash) == block.block_id:
            del self._cached[block.hash]
            slot = self._snapshots.pop(block.hash, None)
            if slot is not None:
                self._free_snapshots.append(slot)
        block.hash = block.key = None

    # -- decode -------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Whether the blocks for computing all of `seq`'s tokens can be had."""
        return len(self._free) >= self.blocks_needed(seq.num_tokens) - len(seq.block_table)

    def may_append(self, seq: Sequence) -> None:
        """Grow the block table to cover all of `seq`'s tokens (call after can_append)."""
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._take_free_block())

    # -- after a step -------------------------------------------------------------------------
    def plan_snapshot(self, seq: Sequence, end: int) -> StateCopy | None:
        """Reserve a snapshot of `seq`'s state after `end` tokens, a full-block boundary.

        Returns the live -> snapshot copy to run after the step, or None when snapshots are
        off, one exists already, or no slot can be had. `commit` publishes it.
        """
        if (
            not self.enable_prefix_caching
            or not self.num_snapshot_slots
            or end <= 0
            or end % self.block_size
            or seq.seq_id in self._pending
        ):
            return None
        h = self._hashes(seq, end // self.block_size)[end // self.block_size - 1]
        if h in self._snapshots or any(p == h for p, _ in self._pending.values()):
            return None
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        elif self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
        else:
            return None  # every slot is pending in this step
        self._pending[seq.seq_id] = (h, slot)
        return StateCopy(seq.state_slot, slot)

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """After `seq.num_computed_tokens` grew by `num_new_tokens`: cache its newly full blocks
        and publish its planned snapshot."""
        if self.enable_prefix_caching:
            bs, end = self.block_size, seq.num_computed_tokens // self.block_size
            hashes = self._hashes(seq, end)
            for i in range((seq.num_computed_tokens - num_new_tokens) // bs, end):
                block = self.blocks[seq.block_table[i]]
                if block.hash is None:
                    block.hash, block.key = hashes[i], self._key(seq, i)
                    self._cached.setdefault(block.hash, block.block_id)
        pending = self._pending.pop(seq.seq_id, None)
        if pending is not None:
            h, slot = pending
            if h in self._snapshots or h not in self._cached:
                self._free_snapshots.append(slot)
            else:
                self._snapshots[h] = slot

    # -- release ------------------------------------------------------------------------------
    def deallocate(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, state slot and any planned snapshot."""
        # Tail blocks go to the free list first so they are evicted before the prefix.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None or self._cached.get(block.hash) != block_id:
                    block.hash = block.key = None
                    self._free.move_to_end(block_id, last=False)  # no cache value: reuse first
        seq.block_table = []
        if seq.state_slot >= 0:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = -1
        pending = self._pending.pop(seq.seq_id, None)
        if pending is not None:
            self._free_snapshots.append(pending[1])
