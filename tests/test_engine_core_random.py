"""Block manager + scheduler under random load, driving a fake model that really uses the cache.

The fake model writes each new token (and its position) into a Python "KV pool" through the
slot mapping, reads the whole sequence back through the block table, and folds tokens into a
per-slot recurrent state (hybrid) that the scheduler's copy instructions move. Its next token
is a hash of what it read back, so a wrong block table, a wrong prefix hit or a wrong state
copy changes the tokens; every finished sequence must equal its solo run.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from text_service.config import EngineConfig
from text_service.sampling_params import SamplingParams
from text_service.scheduler import Scheduler, SchedulerOutput
from text_service.sequence import Sequence, SequenceStatus

VOCAB = 50
EOS = 0
MAX_MODEL_LEN = 24
_INIT_STATE = 17
_MASK = (1 << 61) - 1


def fold(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 1) & _MASK


def next_token(kv_read: list, state: int) -> int:
    return hash((tuple(kv_read), state)) % VOCAB


class FakeModel:
    """Pure-Python stand-in for the model runner: a paged KV pool and a state-slot pool."""

    def __init__(self, cfg: EngineConfig, scheduler: Scheduler):
        self.cfg = cfg
        self.bm = scheduler.block_manager
        self.kv: list = [None] * (cfg.num_kv_blocks * cfg.block_size)
        self.state: list = [None] * cfg.state_pool_size

    def _slot(self, seq: Sequence, pos: int) -> int:
        bs = self.cfg.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def step(self, out: SchedulerOutput) -> list[int | None]:
        bs = self.cfg.block_size
        for c in out.copies_before:
            self.state[c.dst] = self.state[c.src]
        sampled: list[int | None] = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            assert len(seq.block_table) * bs >= start + n
            for pos in range(start, start + n):
                block = self.bm.blocks[seq.block_table[pos // bs]]
                # Only a block this sequence owns alone and that is not cached may be written.
                assert block.ref_count == 1 and block.hash is None
                self.kv[self._slot(seq, pos)] = (pos, seq.token_ids[pos])
            state = 0
            if self.cfg.is_hybrid:
                assert 0 <= seq.state_slot < self.cfg.num_state_slots
                state = self.state[seq.state_slot] if start > 0 else _INIT_STATE
                for pos in range(start, start + n):
                    state = fold(state, seq.token_ids[pos])
                self.state[seq.state_slot] = state
            if start + n == seq.num_tokens:
                read = [self.kv[self._slot(seq, p)] for p in range(start + n)]
                sampled.append(next_token(read, state))
            else:
                sampled.append(None)
        for c in out.copies_after:
            self.state[c.dst] = self.state[c.src]
        return sampled


def solo_run(prompt: list[int], sp: SamplingParams, hybrid: bool, max_model_len: int):
    """What the sequence generates on its own, computed without any cache."""
    tokens = list(prompt)
    while True:
        state = 0
        if hybrid:
            state = _INIT_STATE
            for t in tokens:
                state = fold(state, t)
        t = next_token([(p, x) for p, x in enumerate(tokens)], state)
        tokens.append(t)
        if (t == EOS and not sp.ignore_eos) or t in sp.stop_token_ids:
            return tokens[len(prompt) :], "stop"
        if len(tokens) - len(prompt) >= sp.max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt) :], "length"


def check_invariants(sched: Scheduler, out: SchedulerOutput | None = None) -> None:
    cfg, bm = sched.config, sched.block_manager
    live = sched.running
    owners: dict[int, int] = {}
    for seq in live:
        assert seq.status is SequenceStatus.RUNNING
        assert len(set(seq.block_table)) == len(seq.block_table), "block twice in one table"
        assert len(seq.block_table) >= bm.blocks_needed(seq.num_computed_tokens)
        for b in seq.block_table:
            owners[b] = owners.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), "reference count drifted"
    assert bm.num_free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert not seq.block_table and seq.state_slot == -1 and seq.num_computed_tokens == 0
    if cfg.is_hybrid:
        slots = [seq.state_slot for seq in live]
        assert len(set(slots)) == len(slots) and all(0 <= s < cfg.num_state_slots for s in slots)
        assert bm.state_slots.num_free == cfg.num_state_slots - len(live)
    assert len(live) <= cfg.max_num_seqs
    if out is not None:
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        seqs = out.seqs
        assert len({id(s) for s in seqs}) == len(seqs), "a sequence scheduled twice"
        for seq in out.decode_seqs:
            assert seq.num_tokens - seq.num_computed_tokens == 1
        for seq, n in out.prefill_chunks:
            assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens


def check_all_free(sched: Scheduler) -> None:
    cfg, bm = sched.config, sched.block_manager
    assert not sched.running and not sched.waiting
    assert bm.num_free_blocks == cfg.num_kv_blocks and bm.usage == 0.0
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.state_slots.num_free == cfg.num_state_slots
    assert bm.num_free_snapshot_slots + bm.num_snapshots == bm.num_snapshot_slots


def drive(cfg: EngineConfig, requests: list[dict], max_steps: int = 5000) -> Scheduler:
    """Run requests {prompt, params, arrive, cancel} to completion, checking as it goes."""
    sched = Scheduler(cfg)
    model = FakeModel(cfg, sched)
    seqs = {}
    step = 0
    while step < max_steps:
        for i, r in enumerate(requests):
            if r["arrive"] == step:
                seqs[i] = Sequence(i, r["prompt"], r["params"])
                sched.add(seqs[i])
            if r.get("cancel") == step and i in seqs:
                r["cancelled_as"] = seqs[i].status if not seqs[i].is_finished else None
                r["cancelled_mid_prefill"] = seqs[i].is_prefill and seqs[i].num_computed_tokens > 0
                sched.abort(i)
                check_invariants(sched)
        if step > max(r["arrive"] for r in requests) and not sched.has_unfinished():
            break
        if sched.has_unfinished():
            out = sched.schedule()
            check_invariants(sched, out)
            sched.postprocess(out.seqs, model.step(out))
            check_invariants(sched)
        step += 1
    assert step < max_steps, "no progress"
    check_all_free(sched)
    for i, seq in seqs.items():
        r = requests[i]
        expected, reason = solo_run(r["prompt"], r["params"], cfg.is_hybrid, cfg.max_model_len)
        assert seq.is_finished
        if seq.finish_reason == "abort":
            assert expected[: seq.num_output_tokens] == seq.output_token_ids
        else:
            assert (seq.output_token_ids, seq.finish_reason) == (expected, reason)
    return sched


def random_requests(
    rng: random.Random, n: int, max_model_len: int, cancel_rate: float, horizon: int = 30
) -> list[dict]:
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    reqs = []
    for _ in range(n):
        if reqs and rng.random() < 0.15:
            prompt = list(rng.choice(reqs)["prompt"])  # an exact repeat
        else:
            prompt = (rng.choice(prefixes) if rng.random() < 0.7 else [])[:]
            prompt += [rng.randrange(VOCAB) for _ in range(rng.randrange(0 if prompt else 1, 7))]
            prompt = prompt[: max_model_len - 1]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randrange(1, min(14, max_model_len - len(prompt)) + 1),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=(rng.randrange(VOCAB),) if rng.random() < 0.3 else (),
        )
        arrive = rng.randrange(horizon)
        r = {"prompt": prompt, "params": params, "arrive": arrive}
        if rng.random() < cancel_rate:
            r["cancel"] = arrive + rng.randrange(0, 12)
        reqs.append(r)
    return reqs


def make_config(
    hybrid: bool,
    prefix: bool,
    block_size: int,
    extra_blocks: int,
    max_num_seqs: int,
    budget: int,
    num_state_slots: int,
    snapshots: int,
):
    return EngineConfig(
        vocab_size=VOCAB,
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        num_kv_blocks=MAX_MODEL_LEN // block_size + extra_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(budget, max_num_seqs),
        enable_prefix_caching=prefix,
        is_hybrid=hybrid,
        num_state_slots=num_state_slots if hybrid else 0,
        num_snapshot_slots=snapshots if hybrid else 0,
        eos_token_ids=(EOS,),
    )


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32),
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.integers(0, 6),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(1, 20),
    slots=st.integers(1, 5),
    snapshots=st.integers(0, 4),
    n=st.integers(1, 12),
)
def test_random_load_matches_solo_runs(
    hybrid, prefix, seed, block_size, extra_blocks, max_num_seqs, budget, slots, snapshots, n
):
    cfg = make_config(
        hybrid,
        prefix,
        block_size,
        extra_blocks,
        max_num_seqs,
        budget,
        min(slots, max_num_seqs),
        snapshots,
    )
    rng = random.Random(seed)
    drive(cfg, random_requests(rng, n, cfg.max_model_len, cancel_rate=0.2))


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_shared_prefixes_hit_and_preemption_happens(hybrid):
    """A fixed busy workload: prefix hits and preemptions both really happen, tokens still match."""
    cfg = make_config(hybrid, True, 4, 2, 4, 10, 4, 4)
    rng = random.Random(1234)
    totals = {"hits": 0, "preempt": 0}
    for _ in range(20):
        sched = drive(cfg, random_requests(rng, 12, cfg.max_model_len, 0.0, horizon=6))
        stats = sched.stats()
        totals["hits"] += stats.prefix_cache_hits
        totals["preempt"] += stats.num_preemptions
        assert stats.prefix_cache_queries > 0
    assert totals["hits"] > 0 and totals["preempt"] > 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_200_cancellations_free_everything(hybrid):
    cfg = make_config(hybrid, True, 4, 2, 4, 6, 3, 2)
    rng = random.Random(99)
    reqs = []
    for _ in range(200):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=rng.randrange(1, cfg.max_model_len - len(prompt) + 1),
        )
        arrive = rng.randrange(150)
        reqs.append(
            {
                "prompt": prompt,
                "params": params,
                "arrive": arrive,
                "cancel": arrive + rng.randrange(0, 10),
            }
        )
    sched = drive(cfg, reqs)
    kinds = {"waiting": 0, "prefill": 0, "decode": 0}
    for r in reqs:
        if r.get("cancelled_as") is SequenceStatus.WAITING:
            kinds["waiting"] += 1
        elif r.get("cancelled_as") is SequenceStatus.RUNNING:
            kinds["prefill" if r["cancelled_mid_prefill"] else "decode"] += 1
    assert min(kinds.values()) >= 10, kinds
    check_all_free(sched)
