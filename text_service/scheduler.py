"""Continuous batching: decodes first, then chunked prefills, under a token budget."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from text_service.block_manager import BlockManager, StateCopy
from text_service.config import EngineConfig
from text_service.errors import CapacityError, InvalidRequestError
from text_service.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The work of one step, valid until `Scheduler.postprocess`.

    For each sequence in `seqs` with n = its entry of `num_new_tokens`, the step runs tokens
    `seq.token_ids[c:c+n]` at positions `c..c+n-1`, c = `seq.num_computed_tokens`, writing
    their KV at `seq.block_table[p // block_size] * block_size + p % block_size`; its KV
    length afterwards is c + n and `has_initial_state` is c > 0. Run `copies_before` before the
    forward pass and `copies_after` after it, on every linear-attention state tensor.
    """

    decode_seqs: list[Sequence] = field(default_factory=list)  # one new token each
    prefill_chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    copies_before: list[StateCopy] = field(default_factory=list)  # snapshot -> live (hits)
    copies_after: list[StateCopy] = field(default_factory=list)  # live -> snapshot
    preempted: list[Sequence] = field(default_factory=list)  # back to waiting, KV dropped

    @property
    def seqs(self) -> list[Sequence]:
        """Scheduled sequences in batch order: decodes, then prefill chunks."""
        return self.decode_seqs + [seq for seq, _ in self.prefill_chunks]

    @property
    def num_new_tokens(self) -> list[int]:
        return [1] * len(self.decode_seqs) + [n for _, n in self.prefill_chunks]

    @property
    def num_decodes(self) -> int:
        return len(self.decode_seqs)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decode_seqs) + sum(n for _, n in self.prefill_chunks)

    @property
    def samples(self) -> list[bool]:
        """Per scheduled sequence: whether this step reaches its last token, so it samples."""
        return [
            seq.num_computed_tokens + n == seq.num_tokens
            for seq, n in zip(self.seqs, self.num_new_tokens)
        ]

    @property
    def is_empty(self) -> bool:
        return not self.decode_seqs and not self.prefill_chunks


@dataclass(frozen=True)
class SchedulerStats:
    """Gauges and counters for metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_paused: int = 0


class Scheduler:
    """Admits requests, picks each step's batch, preempts by recompute and applies stops.

    Per step: every running decode gets one token (oldest first; when no block is left the most
    recently admitted running sequence is preempted), then running prefills continue, then
    waiting sequences are admitted in order while blocks, state slots, `max_num_seqs` and the
    `max_num_batched_tokens` budget allow. A sequence gets all blocks for its current tokens at
    admission, so only decodes need new blocks.

    Hybrid models with prefix caching: a hit needs a state snapshot at a block boundary, and a
    snapshot can only be taken where a chunk ends. So prefill chunks are cut to end at
    `(num_tokens - 1) // block_size * block_size`, the longest prefix an identical prompt can
    reuse (its last token is always recomputed), and chunks shortened by the budget are
    rounded down to a block boundary; every prefill chunk ending on a boundary is snapshotted.
    The price is one extra step for a prompt whose tail does not fill a block.

    A paused sequence (its reader is behind) keeps its blocks but gets no decode until resumed.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.block_manager = BlockManager.from_config(config)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.num_preemptions = 0
        self._seqs: dict[object, Sequence] = {}  # every unfinished sequence by id
        self.paused: set[object] = set()  # ids of running sequences not to decode for now
        self._eos = frozenset(config.eos_token_ids)
        self._snapshots = (
            config.is_hybrid and config.enable_prefix_caching and config.num_snapshot_slots > 0
        )
        self._align = self._snapshots and config.enable_chunked_prefill

    # -- requests -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request; raises InvalidRequestError or CapacityError."""
        cfg = self.config
        if seq.seq_id in self._seqs:
            raise InvalidRequestError("request_id", f"{seq.seq_id!r} is already in use")
        seq.sampling_params.validate(cfg.vocab_size, cfg.max_model_len, seq.num_prompt_tokens)
        for t in seq.token_ids:
            if not isinstance(t, int) or not 0 <= t < cfg.vocab_size:
                raise InvalidRequestError(
                    "prompt_token_ids", f"{t!r} is not a token id in [0, {cfg.vocab_size})"
                )
        # The config keeps max_model_len within the pool; checked again so nothing can spin.
        longest = seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1
        if self.block_manager.blocks_needed(longest) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens needs {longest} KV positions, more than the "
                f"whole cache holds ({self.block_manager.num_blocks * cfg.block_size})",
            )
        if len(self.waiting) >= cfg.max_num_waiting:
            raise CapacityError(
                f"the waiting queue is full ({len(self.waiting)} of max_num_waiting="
                f"{cfg.max_num_waiting}); retry later"
            )
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: object) -> Sequence | None:
        """Cancel a request wherever it is and free its cache; None if unknown or finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return seq

    def pause(self, seq_id: object) -> bool:
        """Stop decoding a sequence (it keeps its cache); False if unknown or finished."""
        if seq_id not in self._seqs:
            return False
        self.paused.add(seq_id)
        return True

    def resume(self, seq_id: object) -> None:
        """Decode a paused sequence again (no-op if it is not paused)."""
        self.paused.discard(seq_id)

    def has_schedulable(self) -> bool:
        """Whether a step would have work: an unpaused running sequence or an admissible one."""
        if any(s.seq_id not in self.paused for s in self.running):
            return True
        return (
            bool(self.waiting)
            and len(self.running) < self.config.max_num_seqs
            and self.block_manager.can_allocate(self.waiting[0])
        )

    def get(self, seq_id: object) -> Sequence | None:
        """The unfinished sequence with this id, if any."""
        return self._seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            len(self.running),
            len(self.waiting),
            bm.usage,
            bm.prefix_cache_queries,
            bm.prefix_cache_hits,
            self.num_preemptions,
            len(self.paused),
        )

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick the next step's batch (call `postprocess` after running it)."""
        out = SchedulerOutput()
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens  # >= max_num_seqs: decodes always fit
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.is_prefill or seq.seq_id in self.paused:
                i += 1
                continue
            while not bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.may_append(seq)
                seq.num_scheduled_tokens = 1
                out.decode_seqs.append(seq)
                budget -= 1
                i += 1
        for seq in self.running:
            if budget == 0:
                break
            if seq.is_prefill:
                n = self._chunk_size(seq, budget)
                if n == 0:
                    break
                budget -= self._schedule_chunk(out, seq, n)
        # Do not readmit in a step that had to preempt: blocks are short.
        while (
            self.waiting
            and not out.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                break
            if not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            copy = bm.allocate(seq)
            if copy is not None:
                out.copies_before.append(copy)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = seq.num_cached_tokens
            self.running.append(seq)
            budget -= self._schedule_chunk(out, seq, self._chunk_size(seq, budget))
        # Paused sequences may hold the blocks a waiting one needs: it waits for them to drain.
        if out.is_empty and not out.preempted and self.has_unfinished() and not self.paused:
            raise RuntimeError("scheduler made no progress: " + repr(self.stats()))
        return out

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        start = seq.num_computed_tokens
        remaining = seq.num_tokens - start
        if remaining <= budget:
            n = remaining
        elif not self.config.enable_chunked_prefill:
            return 0
        else:
            n = budget
        if self._align:
            bs = self.config.block_size
            cut = (seq.num_tokens - 1) // bs * bs
            if start < cut < start + n:
                return cut - start
            if n < remaining and (start + n) // bs * bs > start:
                return (start + n) // bs * bs - start
        return n

    def _schedule_chunk(self, out: SchedulerOutput, seq: Sequence, n: int) -> int:
        seq.num_scheduled_tokens = n
        out.prefill_chunks.append((seq, n))
        if self._snapshots:
            copy = self.block_manager.plan_snapshot(seq, seq.num_computed_tokens + n)
            if copy is not None:
                out.copies_after.append(copy)
        return n

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop the KV and state, keep the generated tokens, go first in line.
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- after the step -----------------------------------------------------------------------
    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None]) -> list[Sequence]:
        """Record a step: `token_ids[i]` is the token sampled for `seqs[i]` (ignored, may be
        None, where the step did not reach its last token). Returns the sequences that finished.
        """
        if len(seqs) != len(token_ids):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} token ids")
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            n = seq.num_scheduled_tokens
            if n == 0:  # aborted during the step
                continue
            seq.num_scheduled_tokens = 0
            seq.num_computed_tokens += n
            self.block_manager.commit(seq, n)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # mid-prefill: the sample is meaningless
            if token_id is None:
                raise ValueError(f"no token sampled for sequence {seq.seq_id!r}")
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        sp = seq.sampling_params
        if (token_id in self._eos and not sp.ignore_eos) or token_id in sp.stop_token_ids:
            seq.stop_token_id = token_id
            return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_scheduled_tokens = 0
        self.paused.discard(seq.seq_id)
        del self._seqs[seq.seq_id]
