"""BlockManager: block accounting, prefix caching, LRU eviction, state and snapshot slots."""

from __future__ import annotations

import pytest

from text_service import block_manager as bm_module
from text_service.block_manager import BlockManager, StateCopy, StateSlotPool
from text_service.sequence import Sequence

BS = 4


def seq(seq_id, tokens) -> Sequence:
    return Sequence(seq_id, list(tokens))


def computed(bm: BlockManager, s: Sequence, upto: int | None = None) -> None:
    """Pretend the model ran `s` up to `upto` tokens (all by default) and tell the manager."""
    upto = s.num_tokens if upto is None else upto
    new = upto - s.num_computed_tokens
    s.num_computed_tokens = upto
    bm.commit(s, new)


def admit(bm: BlockManager, s: Sequence) -> StateCopy | None:
    assert bm.can_allocate(s)
    copy = bm.allocate(s)
    s.num_computed_tokens = s.num_cached_tokens
    return copy


def test_allocate_and_deallocate_count_blocks():
    bm = BlockManager(10, BS)
    a = seq("a", range(10))
    admit(bm, a)
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 7 and bm.usage == pytest.approx(0.3)
    assert all(bm.blocks[b].ref_count == 1 for b in a.block_table)
    bm.deallocate(a)
    assert a.block_table == [] and bm.num_free_blocks == 10 and bm.usage == 0.0


def test_can_allocate_is_false_when_blocks_are_short():
    bm = BlockManager(3, BS)
    admit(bm, seq("a", range(8)))
    assert not bm.can_allocate(seq("b", range(5)))
    assert bm.can_allocate(seq("c", range(4)))
    with pytest.raises(RuntimeError):
        bm.allocate(seq("b", range(5)))


def test_prefix_hit_only_after_the_blocks_are_computed():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = seq("a", range(10))
    admit(bm, a)
    b = seq("b", range(10))
    admit(bm, b)
    assert b.num_cached_tokens == 0  # a's KV is not there yet
    computed(bm, a, 6)  # one full block computed
    c = seq("c", range(10))
    admit(bm, c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_cache_queries == 30 and bm.prefix_cache_hits == 4


def test_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = seq("a", range(8))
    admit(bm, a)
    computed(bm, a)
    b = seq("b", range(8))
    admit(bm, b)
    assert b.num_cached_tokens == 4  # not 8: the last token's logits are needed
    c = seq("c", list(range(8)) + [99])
    admit(bm, c)
    assert c.num_cached_tokens == 8


def test_chained_hash_depends_on_the_parent_block():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    computed(bm, a)
    b = seq("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])
    admit(bm, b)
    assert b.num_cached_tokens == 0


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash", lambda _: 42, raising=False)
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 0])
    admit(bm, a)
    computed(bm, a)
    b = seq("b", [5, 6, 7, 8, 0])  # same (forced) hash, other tokens
    admit(bm, b)
    assert b.num_cached_tokens == 0
    c = seq("c", [1, 2, 3, 4, 0])
    admit(bm, c)
    assert c.num_cached_tokens == 4


def test_prefix_caching_off_never_hits_nor_counts():
    bm = BlockManager(10, BS)
    a = seq("a", range(9))
    admit(bm, a)
    computed(bm, a)
    b = seq("b", range(9))
    admit(bm, b)
    assert b.num_cached_tokens == 0 and bm.num_cached_blocks == 0
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0


def test_freed_cached_blocks_stay_reusable_and_count_when_revived():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = seq("a", range(13))
    admit(bm, a)
    table = list(a.block_table)
    computed(bm, a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 3
    b = seq("b", range(13))
    assert bm.can_allocate(b)
    admit(bm, b)
    assert b.num_cached_tokens == 12 and b.block_table[:3] == table[:3]
    assert bm.num_free_blocks == 0
    # Revived free blocks left the free list: nothing else fits now.
    assert not bm.can_allocate(seq("c", [7]))


def test_can_allocate_counts_free_blocks_a_hit_revives():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = seq("a", range(9))
    admit(bm, a)
    computed(bm, a)
    bm.deallocate(a)
    # 3 blocks needed, 2 of them cached and free: the free list must cover all three.
    assert bm.can_allocate(seq("b", range(9)))
    admit(bm, seq("x", [5]))
    assert not bm.can_allocate(seq("b", range(9)))


def test_free_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a, d = seq("a", [1] * 9), seq("d", [2] * 9)
    for s in (a, d):
        admit(bm, s)
        computed(bm, s)
    bm.deallocate(a)  # freed first
    bm.deallocate(d)
    # Three blocks: the two partial (uncached) blocks, then a's tail block.
    admit(bm, seq("x", [3] * 9))
    assert len(bm._lookup(seq("a2", [1] * 9))[0]) == 1
    assert len(bm._lookup(seq("d2", [2] * 9))[0]) == 2


def test_uncached_free_blocks_are_taken_before_cached_ones():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = seq("a", range(6))  # one full block (cached once computed) and a partial one
    admit(bm, a)
    first = a.block_table[0]
    computed(bm, a)
    bm.deallocate(a)
    admit(bm, seq("x", [9] * 12))  # three blocks: the cached one must be spared
    assert bm._lookup(seq("a2", range(6)))[0] == [first]


def test_can_append_and_may_append_at_a_block_boundary():
    bm = BlockManager(3, BS)
    a = seq("a", range(8))
    admit(bm, a)
    a.num_computed_tokens = 8
    a.append_token(1)  # the 9th token needs a third block
    assert bm.can_append(a)
    bm.may_append(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 0
    a.num_computed_tokens = 9
    a.append_token(2)  # still fits the third block
    assert bm.can_append(a)
    bm.may_append(a)
    assert len(a.block_table) == 3
    bm.deallocate(a)

    b, c = seq("b", range(8)), seq("c", [1])
    admit(bm, b)
    admit(bm, c)
    b.append_token(5)
    assert not bm.can_append(b)
    bm.deallocate(c)
    assert bm.can_append(b)


def test_state_slot_pool_hands_out_each_slot_once():
    pool = StateSlotPool(2)
    x, y = pool.allocate(), pool.allocate()
    assert {x, y} == {0, 1} and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.free(x)
    with pytest.raises(RuntimeError):
        pool.free(x)
    assert pool.allocate() == x


def hybrid(num_blocks=10, slots=2, snapshots=2) -> BlockManager:
    return BlockManager(
        num_blocks,
        BS,
        enable_prefix_caching=True,
        num_state_slots=slots,
        num_snapshot_slots=snapshots,
    )


def test_hybrid_takes_and_returns_a_state_slot():
    bm = hybrid(slots=1)
    a = seq("a", range(5))
    admit(bm, a)
    assert a.state_slot == 0 and not bm.can_allocate(seq("b", [1]))
    bm.deallocate(a)
    assert a.state_slot == -1 and bm.state_slots.num_free == 1


def test_hybrid_hit_needs_a_published_snapshot_at_the_boundary():
    bm = hybrid(num_blocks=12, slots=3)
    a = seq("a", range(10))
    admit(bm, a)
    computed(bm, a)
    bm.deallocate(a)
    b = seq("b", range(10))
    assert admit(bm, b) is None and b.num_cached_tokens == 0  # KV cached, no snapshot
    bm.deallocate(b)

    c = seq("c", range(10))
    admit(bm, c)
    copy = bm.plan_snapshot(c, 4)
    assert copy.src == c.state_slot and copy.dst >= 3  # snapshot slots follow the live ones
    assert bm.plan_snapshot(seq("z", range(10)), 6) is None  # not a block boundary
    d = seq("d", range(10))
    admit(bm, d)
    assert d.num_cached_tokens == 0  # planned, not yet published
    bm.deallocate(d)
    computed(bm, c, 4)
    f = seq("f", range(10))
    assert admit(bm, f) == StateCopy(copy.dst, f.state_slot)
    assert f.num_cached_tokens == 4  # 8 tokens of KV are cached but have no snapshot
    assert bm.prefix_cache_hits == 4


def test_snapshot_is_dropped_with_its_block():
    bm = hybrid(num_blocks=3, snapshots=1)
    a = seq("a", range(6))
    admit(bm, a)
    bm.plan_snapshot(a, 4)
    computed(bm, a)
    bm.deallocate(a)
    assert bm.num_snapshots == 1
    admit(bm, seq("x", [7] * 12))  # takes all three blocks, evicting the cached one
    assert bm.num_snapshots == 0 and bm.num_free_snapshot_slots == 1


def test_snapshots_are_evicted_lru_when_slots_run_out():
    bm = hybrid(snapshots=1)
    a, b = seq("a", [1] * 6), seq("b", [2] * 6)
    for s in (a, b):
        admit(bm, s)
        assert bm.plan_snapshot(s, 4) is not None
        computed(bm, s)
        bm.deallocate(s)
    assert bm.num_snapshots == 1
    a2, b2 = seq("a2", [1] * 6), seq("b2", [2] * 6)
    admit(bm, a2)
    admit(bm, b2)
    assert a2.num_cached_tokens == 0 and b2.num_cached_tokens == 4


def test_deallocate_releases_a_planned_snapshot():
    bm = hybrid(snapshots=1)
    a = seq("a", range(6))
    admit(bm, a)
    assert bm.plan_snapshot(a, 4) is not None
    assert bm.num_free_snapshot_slots == 0
    bm.deallocate(a)
    assert bm.num_free_snapshot_slots == 1 and bm.num_snapshots == 0
