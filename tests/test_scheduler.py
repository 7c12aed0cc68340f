"""SamplingParams, EngineConfig and Scheduler behaviour, one rule per test."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from text_service.block_manager import BlockManager, StateCopy
from text_service.config import EngineConfig
from text_service.errors import CapacityError, InvalidRequestError
from text_service.sampling_params import SamplingParams
from text_service.scheduler import Scheduler, SchedulerOutput
from text_service.sequence import Sequence, SequenceStatus

ROOT = Path(__file__).resolve().parents[1]
EOS = 2


def config(**kw) -> EngineConfig:
    base = dict(
        vocab_size=100,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        eos_token_ids=(EOS,),
    )
    base.update(kw)
    return EngineConfig(**base)


def new_seq(seq_id, n_prompt, **sp) -> Sequence:
    sp.setdefault("ignore_eos", True)
    sp.setdefault("max_tokens", 16)
    return Sequence(seq_id, [10 + (i % 50) for i in range(n_prompt)], SamplingParams(**sp))


def step(sched: Scheduler, token: int = 7, out: SchedulerOutput | None = None):
    """Schedule (unless given), 'run' with a constant token, postprocess."""
    out = sched.schedule() if out is None else out
    finished = sched.postprocess(out.seqs, [token if s else None for s in out.samples])
    return out, finished


def all_free(sched: Scheduler) -> bool:
    bm = sched.block_manager
    return (
        bm.num_free_blocks == bm.num_blocks
        and bm.state_slots.num_free == bm.state_slots.num_slots
        and not sched.running
        and not sched.waiting
    )


# -- SamplingParams --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=60), "max_tokens"),  # 10 + 60 > 64
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_window=-1), "repetition_window"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[100]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(allowed_token_range=(5, 4)), "allowed_token_range"),
        (dict(allowed_token_range=(0, 100)), "allowed_token_range"),
        (dict(allowed_token_range=(1,)), "allowed_token_range"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(kwargs, field):
    kwargs = {"max_tokens": 16, **kwargs}
    SamplingParams(max_tokens=16).validate(vocab_size=100, max_model_len=64, prompt_len=10)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs).validate(vocab_size=100, max_model_len=64, prompt_len=10)
    assert err.value.field == field and field in str(err.value) and err.value.rule


def test_sampling_params_reject_empty_and_overlong_prompts():
    for prompt_len in (0, 64):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(max_tokens=1).validate(100, 64, prompt_len)
        assert err.value.field == "prompt_token_ids"


def test_sampling_params_accept_good_values_and_normalise_lists():
    sp = SamplingParams(
        temperature=0,
        top_k=5,
        top_p=0.9,
        repetition_penalty=1.2,
        seed=3,
        max_tokens=54,
        stop_token_ids=[9, 8],
        allowed_token_range=[20, 99],
    )
    sp.validate(vocab_size=100, max_model_len=64, prompt_len=10)
    assert sp.is_greedy and sp.stop_token_ids == (9, 8) and sp.allowed_token_range == (20, 99)
    assert sp.exempt_token_ids((EOS,)) == (9, 8, EOS)
    assert dataclasses.replace(sp, ignore_eos=True).exempt_token_ids((EOS,)) == (9, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.temperature = 1.0


def test_errors_carry_their_grpc_status_names():
    assert InvalidRequestError("top_p", "x").status_code == "INVALID_ARGUMENT"
    assert CapacityError("full").status_code == "RESOURCE_EXHAUSTED"


# -- EngineConfig ----------------------------------------------------------------------------
def test_config_rejects_a_pool_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="max_model_len"):
        config(num_kv_blocks=15)  # 60 < 64 token positions


def test_config_rejects_a_budget_below_one_decode_per_sequence():
    with pytest.raises(ValueError, match="max_num_seqs"):
        config(max_num_batched_tokens=3)


def test_config_defaults_live_state_slots_to_max_num_seqs_and_is_frozen():
    cfg = config(is_hybrid=True, num_snapshot_slots=3)
    assert cfg.num_state_slots == 4 and cfg.state_pool_size == 7
    assert cfg.max_blocks_per_seq == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 8
    with pytest.raises(ValueError):
        config(num_state_slots=2)  # dense models keep no state


# -- add / admission -------------------------------------------------------------------------
def test_add_validates_sampling_params_and_prompt_ids():
    sched = Scheduler(config())
    with pytest.raises(InvalidRequestError) as err:
        sched.add(new_seq("a", 10, top_p=0))
    assert err.value.field == "top_p"
    with pytest.raises(InvalidRequestError) as err:
        sched.add(Sequence("b", [1, 200], SamplingParams(max_tokens=4)))
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError):
        sched.add(Sequence("c", [], SamplingParams()))
    assert not sched.has_unfinished()


def test_add_rejects_a_duplicate_id():
    sched = Scheduler(config())
    sched.add(new_seq("a", 4))
    with pytest.raises(InvalidRequestError) as err:
        sched.add(new_seq("a", 4))
    assert err.value.field == "request_id"


def test_add_rejects_a_request_that_can_never_fit():
    sched = Scheduler(config())
    sched.block_manager = BlockManager(2, 4)  # smaller than any config allows
    with pytest.raises(InvalidRequestError) as err:
        sched.add(new_seq("a", 6, max_tokens=4))
    assert err.value.field == "max_tokens" and not sched.has_unfinished()


def test_add_caps_the_waiting_queue():
    sched = Scheduler(config(max_num_waiting=2))
    sched.add(new_seq("a", 4))
    sched.add(new_seq("b", 4))
    with pytest.raises(CapacityError):
        sched.add(new_seq("c", 4))
    step(sched)  # both admitted: room again
    sched.add(new_seq("c", 4))


# -- schedule --------------------------------------------------------------------------------
def test_decodes_come_first_then_prefill_chunks_under_the_budget():
    sched = Scheduler(config(max_num_batched_tokens=10))
    sched.add(new_seq("a", 3, max_tokens=20))
    sched.add(new_seq("b", 3, max_tokens=20))
    out, _ = step(sched)
    assert [(s.seq_id, n) for s, n in out.prefill_chunks] == [("a", 3), ("b", 3)]
    sched.add(new_seq("long", 30, max_tokens=4))
    out, _ = step(sched)
    assert [s.seq_id for s in out.decode_seqs] == ["a", "b"] and out.num_decodes == 2
    assert [(s.seq_id, n) for s, n in out.prefill_chunks] == [("long", 8)]
    assert out.seqs[0].seq_id == "a" and out.num_new_tokens == [1, 1, 8]
    assert out.num_batched_tokens == 10
    chunks = [8]
    while sched.get("long").is_prefill:
        out, _ = step(sched)
        assert out.num_batched_tokens <= 10 and len(out.decode_seqs) == 2
        chunks.append({s.seq_id: n for s, n in out.prefill_chunks}["long"])
    assert chunks == [8, 8, 8, 6]


def test_no_token_is_appended_until_the_prefill_completes():
    sched = Scheduler(config(max_num_batched_tokens=8))
    s = new_seq("a", 20, max_tokens=3)
    sched.add(s)
    out, _ = step(sched)
    assert out.samples == [False] and s.num_computed_tokens == 8 and s.num_output_tokens == 0
    step(sched)
    out = sched.schedule()
    assert out.prefill_chunks == [(s, 4)] and out.samples == [True]
    step(sched, out=out)
    assert s.output_token_ids == [7] and s.num_computed_tokens == 20


def test_running_sequences_never_exceed_max_num_seqs():
    sched = Scheduler(config(max_num_seqs=2))
    for i in range(5):
        sched.add(new_seq(i, 2, max_tokens=5))
    out, _ = step(sched)
    assert len(out.seqs) == 2 and len(sched.running) == 2 and len(sched.waiting) == 3


def test_without_chunked_prefill_a_prompt_runs_whole():
    sched = Scheduler(config(enable_chunked_prefill=False, max_num_batched_tokens=64))
    sched.add(new_seq("a", 40, max_tokens=2))
    sched.add(new_seq("b", 30, max_tokens=2))
    out, _ = step(sched)
    assert [(s.seq_id, n) for s, n in out.prefill_chunks] == [("a", 40)]  # b waits


# -- postprocess and stops -------------------------------------------------------------------
def test_eos_stops_unless_ignored():
    sched = Scheduler(config())
    a = new_seq("a", 3, max_tokens=5, ignore_eos=False)
    b = new_seq("b", 3, max_tokens=5, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    _, finished = step(sched, token=EOS)
    assert finished == [a] and a.finish_reason == "stop" and a.stop_token_id == EOS
    assert a.output_token_ids == [EOS] and a.status is SequenceStatus.FINISHED
    assert a.block_table == [] and b.finish_reason is None
    assert sched.get("a") is None and sched.get("b") is b


def test_stop_token_ids_and_max_tokens():
    sched = Scheduler(config())
    a = new_seq("a", 3, max_tokens=5, stop_token_ids=[7])
    b = new_seq("b", 3, max_tokens=2)
    sched.add(a)
    sched.add(b)
    _, finished = step(sched, token=8)
    assert finished == []
    _, finished = step(sched, token=7)
    assert set(finished) == {a, b}
    assert (a.finish_reason, a.stop_token_id, a.output_token_ids) == ("stop", 7, [8, 7])
    assert (b.finish_reason, b.stop_token_id, b.output_token_ids) == ("length", None, [8, 7])
    assert all_free(sched)


def test_postprocess_checks_lengths_and_missing_samples():
    sched = Scheduler(config())
    sched.add(new_seq("a", 3))
    out = sched.schedule()
    with pytest.raises(ValueError):
        sched.postprocess(out.seqs, [])
    with pytest.raises(ValueError):
        sched.postprocess(out.seqs, [None])


# -- preemption ------------------------------------------------------------------------------
def test_preempts_the_most_recently_admitted_by_recompute():
    # 4 blocks of 4: a and b (7-token prompts, 2 blocks each) fill the pool.
    sched = Scheduler(config(max_model_len=16, num_kv_blocks=4, max_num_batched_tokens=16))
    a, b = new_seq("a", 7, max_tokens=8), new_seq("b", 7, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)  # prefill both: 8 tokens each
    step(sched)  # decode the 8th token: 9 tokens each, still 2 blocks
    out, _ = step(sched)  # a's 9th token needs a third block: b goes
    assert out.preempted == [b] and [s.seq_id for s in out.decode_seqs] == ["a"]
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.output_token_ids == [7, 7]
    assert b.num_preemptions == 1 and sched.stats().num_preemptions == 1
    while sched.has_unfinished():
        step(sched)
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert all_free(sched)


def test_preemption_frees_the_state_slot_and_sends_it_first_in_line():
    sched = Scheduler(config(max_model_len=16, num_kv_blocks=4, is_hybrid=True))
    a, b, c = (new_seq(x, 7, max_tokens=8) for x in "abc")
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert c.status is SequenceStatus.WAITING  # no blocks left for c
    step(sched)
    out, _ = step(sched)
    assert out.preempted == [b] and b.state_slot == -1
    assert list(sched.waiting) == [b, c]
    assert sched.block_manager.state_slots.num_free == sched.config.num_state_slots - 1


# -- abort -----------------------------------------------------------------------------------
def test_abort_while_waiting_mid_prefill_and_decoding_frees_everything():
    sched = Scheduler(config(max_num_batched_tokens=8, is_hybrid=True, max_num_seqs=2))
    dec, pre, wait = new_seq("dec", 3, max_tokens=9), new_seq("pre", 30), new_seq("wait", 3)
    for s in (dec, pre, wait):
        sched.add(s)
    step(sched)
    step(sched)
    assert dec.num_output_tokens == 2 and pre.is_prefill and pre.num_computed_tokens > 0
    assert wait.status is SequenceStatus.WAITING
    for s in (wait, pre, dec):
        assert sched.abort(s.seq_id) is s
        assert s.finish_reason == "abort" and s.block_table == [] and s.state_slot == -1
    assert all_free(sched) and sched.abort("dec") is None and sched.abort("nope") is None


def test_abort_during_a_step_is_skipped_by_postprocess():
    sched = Scheduler(config())
    a, b = new_seq("a", 3, max_tokens=4), new_seq("b", 3, max_tokens=4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("a")
    step(sched, out=out)
    assert a.output_token_ids == [] and a.num_computed_tokens == 0 and a.finish_reason == "abort"
    assert b.output_token_ids == [7]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - 1


# -- hybrid prefix caching -------------------------------------------------------------------
def hybrid_config(**kw) -> EngineConfig:
    return config(is_hybrid=True, num_state_slots=4, num_snapshot_slots=2, **kw)


def test_hybrid_prefill_is_cut_at_the_last_full_block_and_snapshotted():
    sched = Scheduler(hybrid_config())
    a = new_seq("a", 10, max_tokens=3)
    sched.add(a)
    out, _ = step(sched)
    assert out.prefill_chunks == [(a, 8)] and out.copies_before == []
    assert len(out.copies_after) == 1 and out.copies_after[0].src == a.state_slot
    snapshot = out.copies_after[0].dst
    assert snapshot in (4, 5)  # snapshot slots come after the 4 live ones
    out, _ = step(sched)
    assert out.prefill_chunks == [(a, 2)] and out.copies_after == []
    # The same prompt later resumes from the snapshot: copy it in before the step.
    b = new_seq("b", 10, max_tokens=3)
    sched.add(b)
    out, _ = step(sched)
    assert b.num_cached_tokens == 8 and out.prefill_chunks == [(b, 2)]
    assert out.copies_before == [StateCopy(snapshot, b.state_slot)]
    assert sched.stats().prefix_cache_hits == 8


def test_hybrid_budget_limited_chunks_end_on_block_boundaries():
    sched = Scheduler(hybrid_config(max_num_batched_tokens=7))
    a = new_seq("a", 22, max_tokens=2)
    sched.add(a)
    sizes = []
    while a.is_prefill or a.num_computed_tokens == 0:
        out, _ = step(sched)
        sizes.append(out.prefill_chunks[0][1])
    assert sizes == [4, 4, 4, 4, 4, 2]  # 20 = (22 - 1) // 4 * 4 is the cut


def test_dense_models_are_not_cut():
    sched = Scheduler(config())
    a = new_seq("a", 10)
    sched.add(a)
    out, _ = step(sched)
    assert out.prefill_chunks == [(a, 10)] and out.copies_after == []


def test_dense_prefix_hit_skips_cached_tokens():
    sched = Scheduler(config())
    a = new_seq("a", 10, max_tokens=1)
    sched.add(a)
    step(sched)
    b = new_seq("b", 10, max_tokens=1)
    sched.add(b)
    out, _ = step(sched)
    assert out.prefill_chunks == [(b, 2)] and b.num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_stats_report_queue_sizes_and_kv_usage():
    sched = Scheduler(config(max_num_seqs=1))
    sched.add(new_seq("a", 8, max_tokens=4))
    sched.add(new_seq("b", 8, max_tokens=4))
    step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 32)  # a's 9th token needs no block yet


# -- pausing (a slow reader) ----------------------------------------------------------------
def test_a_paused_sequence_keeps_its_blocks_but_gets_no_decode_until_resumed():
    sched = Scheduler(config())
    a, b = new_seq("a", 3, max_tokens=10), new_seq("b", 3, max_tokens=10)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.pause("a") and sched.stats().num_paused == 1
    blocks = list(a.block_table)
    for _ in range(3):
        out, _ = step(sched)
        assert [s.seq_id for s in out.seqs] == ["b"]
    assert a.num_output_tokens == 1 and a.block_table == blocks and b.num_output_tokens == 4
    sched.resume("a")
    out, _ = step(sched)
    assert [s.seq_id for s in out.seqs] == ["a", "b"] and a.num_output_tokens == 2


def test_only_paused_sequences_means_nothing_to_schedule_and_no_error():
    sched = Scheduler(config(max_num_seqs=1))
    sched.add(new_seq("a", 3, max_tokens=10))
    sched.add(new_seq("b", 3, max_tokens=10))
    step(sched)
    sched.pause("a")
    assert not sched.has_schedulable()  # b waits for a's seat
    assert sched.schedule().is_empty and sched.has_unfinished()
    sched.resume("a")
    assert sched.has_schedulable()


def test_finishing_or_aborting_forgets_the_pause():
    sched = Scheduler(config())
    sched.add(new_seq("a", 3, max_tokens=2))
    sched.add(new_seq("b", 3, max_tokens=10))
    step(sched)
    sched.pause("a")
    sched.pause("b")
    sched.resume("a")
    step(sched)  # a's second token: it finishes
    assert sched.get("a") is None and sched.paused == {"b"}
    sched.abort("b")
    assert sched.paused == set() and not sched.pause("b") and not sched.pause("nope")


# -- no torch --------------------------------------------------------------------------------
def test_engine_core_imports_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        "import text_service.errors, text_service.config, text_service.sampling_params\n"
        "import text_service.sequence, text_service.block_manager, text_service.scheduler\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
