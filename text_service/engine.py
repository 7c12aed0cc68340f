"""The synchronous engine: requests in, one scheduled and sampled step per `step()` call."""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from servicekit.device import parse_dtype, select_device
from text_service.config import EngineConfig
from text_service.hf_config import load_hf_config
from text_service.model_runner import ModelRunner
from text_service.sampling_params import SamplingParams
from text_service.scheduler import Scheduler
from text_service.sequence import Sequence

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class EngineArgs:
    """How to build an LLMEngine; the pools are sized from `kv_cache_memory_bytes`."""

    model: str  # HF-format directory
    device: str = "auto"  # servicekit.device.select_device
    dtype: str | None = None  # None = the checkpoint's dtype
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30  # budget for KV blocks + linear-attention state slots
    num_kv_blocks: int | None = None  # overrides the budget
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = min(config max_position_embeddings, 8192)
    enable_prefix_caching: bool = True
    num_snapshot_slots: int = 64
    max_num_waiting: int = 1024
    seed: int = 0
    # decode-only steps of up to this many sequences replay captured graphs (CPU only)
    decode_graphs: int = 8


@dataclass
class StepOutput:
    """What one step did for one request."""

    seq: Sequence  # seq.seq_id is the request id
    new_token_ids: list[int]  # tokens sampled in this step (0 or 1)
    finished: bool


def read_eos_token_ids(model_dir: str | Path, model_config) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else from the model config (may be empty)."""
    eos = None
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(model_config, "eos_token_id", None)
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _load_tokenizer(model_dir: str | Path):
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


class LLMEngine:
    """Scheduler + model runner. Not thread-safe: call every method from one thread."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.model_config = load_hf_config(args.model)
        self.device = select_device(args.device)
        max_positions = self.model_config.max_position_embeddings
        max_model_len = args.max_model_len or min(max_positions, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > max_positions:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={max_positions}"
            )
        vocab_size = self.model_config.vocab_size
        eos = read_eos_token_ids(args.model, self.model_config)
        if any(not 0 <= t < vocab_size for t in eos):
            log.warning("ignoring EOS ids outside the vocabulary: %s", eos)
            eos = tuple(t for t in eos if 0 <= t < vocab_size)
        self.runner = ModelRunner(
            args.model,
            self.device,
            parse_dtype(args.dtype) if args.dtype else None,
            max_model_len,
            eos,
            args.seed,
            decode_graphs=args.decode_graphs,
        )
        self.dtype = self.runner.dtype
        hybrid = self.runner.is_hybrid
        num_state_slots = args.max_num_seqs if hybrid else 0
        num_snapshot_slots = args.num_snapshot_slots if hybrid and args.enable_prefix_caching else 0
        num_kv_blocks = args.num_kv_blocks
        if num_kv_blocks is None:
            num_kv_blocks = self.runner.num_kv_blocks_for(
                args.kv_cache_memory_bytes,
                block_size=args.block_size,
                num_state_slots=num_state_slots + num_snapshot_slots,
                max_num_seqs=args.max_num_seqs,
                max_model_len=max_model_len,
            )
        self.config = EngineConfig(
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            block_size=args.block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_waiting=args.max_num_waiting,
            enable_prefix_caching=args.enable_prefix_caching,
            is_hybrid=hybrid,
            num_state_slots=num_state_slots,
            num_snapshot_slots=num_snapshot_slots,
            eos_token_ids=eos,
        )
        self.runner.allocate_caches(self.config)
        self.scheduler = Scheduler(self.config)
        self.tokenizer = _load_tokenizer(args.model)
        self._generate_ids = itertools.count()
        log.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d, %d state + %d snapshot slots, "
            "%.1f MiB of caches, decode graphs for batch sizes %s",
            self.model_config.model_type,
            self.device,
            self.dtype,
            num_kv_blocks,
            args.block_size,
            num_state_slots,
            num_snapshot_slots,
            self.runner.cache_bytes() / 2**20,
            self.runner.graphs.sizes or "none",
        )

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request; raises InvalidRequestError (bad input) or CapacityError (queue full)."""
        if arrival_time is None:
            arrival_time = time.perf_counter()
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id) -> bool:
        """Cancel a request and free its cache; False when it is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        seq.finished_time = time.perf_counter()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def pause_request(self, request_id) -> bool:
        """Stop decoding a request until `resume_request` (its reader is behind)."""
        return self.scheduler.pause(request_id)

    def resume_request(self, request_id) -> None:
        self.scheduler.resume(request_id)

    def has_runnable_requests(self) -> bool:
        """Whether `step` has work now (paused requests alone do not count)."""
        return self.scheduler.has_schedulable()

    # -- steps --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule, run and sample one step; one StepOutput per request that got a token."""
        batch = self.scheduler.schedule()
        seqs = batch.seqs
        if not seqs:
            return []
        now = time.perf_counter()
        for seq in seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        token_ids = self.runner.execute(batch)
        self.scheduler.postprocess(seqs, token_ids)
        now = time.perf_counter()
        outputs = []
        for seq, token_id in zip(seqs, token_ids):
            if token_id is None:
                continue  # mid-prefill
            if seq.prefill_done_time is None:
                seq.prefill_done_time = now
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.is_finished:
                seq.finished_time = now
            outputs.append(StepOutput(seq, [token_id], seq.is_finished))
        return outputs

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (offline); returns each one's output token ids in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        pending = list(zip(prompts, params))
        pending.reverse()
        seqs: list[Sequence] = []
        try:
            while pending or not all(seq.is_finished for seq in seqs):
                # Feed the queue as it drains so any number of prompts fits max_num_waiting.
                while pending and len(self.scheduler.waiting) < self.config.max_num_waiting:
                    prompt, sp = pending.pop()
                    request_id = f"generate-{next(self._generate_ids)}"
                    seqs.append(self.add_request(request_id, prompt, sp))
                self.step()
        except BaseException:
            for seq in seqs:
                self.abort_request(seq.seq_id)
            raise
        return [seq.output_token_ids for seq in seqs]

    def stats(self) -> dict:
        """Gauges and counters for metrics and tests."""
        sched = self.scheduler.stats()
        bm = self.scheduler.block_manager
        return {
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "kv_cache_usage": sched.kv_cache_usage,
            "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
            "num_used_state_slots": bm.state_slots.num_slots - bm.state_slots.num_free,
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "num_paused": sched.num_paused,
        }
