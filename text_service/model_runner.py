"""Runs scheduled steps on the model: cache pools, per-step metadata, forward, logits, sampling."""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import torch

from servicekit.memory import keep_onednn_primitives, retain_freed_memory
from text_service.config import EngineConfig
from text_service.context import Context, reset_context, set_context
from text_service.decode_graphs import DecodeGraphs
from text_service.loader import load_model
from text_service.models.cache import (
    allocate_caches,
    copy_state_slots,
    kv_bytes_per_block,
    kv_pools,
    state_bytes_per_slot,
    state_pools,
)
from text_service.sampler import Sampler
from text_service.scheduler import SchedulerOutput
from text_service.sequence import Sequence


class _SeqArrays:
    """Numpy copies of a sequence's block table and token ids, grown as the lists grow."""

    __slots__ = ("admission", "table", "num_blocks", "tokens", "num_tokens")

    def __init__(self) -> None:
        self.admission = -1  # num_preemptions when the table was copied: a readmission resets it
        self.table = np.empty(0, dtype=np.int32)
        self.num_blocks = 0
        self.tokens: np.ndarray | None = None
        self.num_tokens = 0

    def block_table(self, seq: Sequence) -> np.ndarray:
        # Within one admission the block manager only appends to a block table.
        blocks = seq.block_table
        if self.admission != seq.num_preemptions or len(blocks) < self.num_blocks:
            self.admission, self.num_blocks = seq.num_preemptions, 0
        n = len(blocks)
        if n > self.num_blocks:
            if n > len(self.table):
                grown = np.empty(max(n, 2 * len(self.table)), dtype=np.int32)
                grown[: self.num_blocks] = self.table[: self.num_blocks]
                self.table = grown
            self.table[self.num_blocks : n] = blocks[self.num_blocks :]
            self.num_blocks = n
        return self.table[:n]

    def token_ids(self, seq: Sequence) -> np.ndarray:
        # Token ids are append-only for the life of a sequence.
        ids, n = seq.token_ids, len(seq.token_ids)
        if self.tokens is None or n > len(self.tokens):
            grown = np.empty(
                max(n, 64, 2 * (0 if self.tokens is None else len(self.tokens))), dtype=np.int64
            )
            if self.tokens is not None:
                grown[: self.num_tokens] = self.tokens[: self.num_tokens]
            self.tokens = grown
        if n > self.num_tokens:
            self.tokens[self.num_tokens : n] = ids[self.num_tokens :]
            self.num_tokens = n
        return self.tokens[:n]


class ModelRunner:
    """Owns the model, its KV and state pools and the sampler; runs one SchedulerOutput a step."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype | None,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
        decode_graphs: int = 0,
    ):
        """`decode_graphs`: decode-only steps of up to this many sequences replay a graph
        captured once per batch size (CPU only; text_service.decode_graphs), 0 for none."""
        if decode_graphs < 0:
            raise ValueError(f"decode_graphs must be >= 0, got {decode_graphs}")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            retain_freed_memory()
            keep_onednn_primitives()  # one per projection and row count
        self.model = load_model(
            model_dir, device=self.device, dtype=dtype, max_positions=max_model_len
        )
        self.model.pack_weights()
        self.dtype = self.model.dtype
        self.vocab_size = self.model.config.vocab_size
        self.is_hybrid = bool(self.model.linear_attention_layers())
        self.sampler = Sampler(self.vocab_size, self.device, eos_token_ids, seed)
        self.config: EngineConfig | None = None
        self.decode_graph_seqs = decode_graphs if self.device.type == "cpu" else 0
        self.graphs = DecodeGraphs({})
        self._arrays: weakref.WeakKeyDictionary[Sequence, _SeqArrays] = weakref.WeakKeyDictionary()

    # -- cache pools --------------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block costs over all full-attention layers (0 without any)."""
        return kv_bytes_per_block(self.model, block_size)

    def state_bytes_per_slot(self) -> int:
        """Bytes one state slot costs over all linear-attention layers (0 without any)."""
        return state_bytes_per_slot(self.model)

    def num_kv_blocks_for(
        self,
        memory_bytes: int,
        *,
        block_size: int,
        num_state_slots: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> int:
        """KV blocks that fit `memory_bytes` once `num_state_slots` state slots are paid for.

        A model without full-attention layers stores no KV: its blocks only count tokens for
        the scheduler, so it gets enough for `max_num_seqs` sequences of `max_model_len`.
        """
        state_bytes = num_state_slots * self.state_bytes_per_slot()
        if state_bytes > memory_bytes:
            raise ValueError(
                f"kv_cache_memory_bytes={memory_bytes} cannot hold {num_state_slots} "
                f"linear-attention state slots of {self.state_bytes_per_slot()} bytes each: raise "
                "it or lower max_num_seqs / num_snapshot_slots"
            )
        per_block = self.kv_bytes_per_block(block_size)
        if per_block == 0:
            return max_num_seqs * -(-max_model_len // block_size)
        num_blocks = (memory_bytes - state_bytes) // per_block
        if num_blocks * block_size < max_model_len:
            raise ValueError(
                f"kv_cache_memory_bytes={memory_bytes} leaves room for {num_blocks} KV blocks "
                f"({num_blocks * block_size} tokens) after the state slots, less than one "
                f"sequence of max_model_len={max_model_len}: raise it or lower max_model_len"
            )
        return num_blocks

    def allocate_caches(self, config: EngineConfig) -> None:
        """Allocate zeroed KV and state pools sized by `config` and attach them to the model."""
        # A model without full-attention layers allocates no KV whatever num_kv_blocks says.
        allocate_caches(
            self.model,
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            num_slots=config.state_pool_size,
            device=self.device,
        )
        self.config = config
        if self.decode_graph_seqs:
            self.graphs = DecodeGraphs.capture_all(
                self.model,
                min(self.decode_graph_seqs, config.max_num_seqs),
                block_size=config.block_size,
                num_kv_blocks=config.num_kv_blocks,
                max_blocks=config.max_blocks_per_seq,
            )

    def cache_bytes(self) -> int:
        """Bytes held by the attached KV and state pools."""
        return sum(t.nbytes for t in kv_pools(self.model) + state_pools(self.model))

    # -- one step -----------------------------------------------------------------------------
    def _arrays_of(self, seq: Sequence) -> _SeqArrays:
        arrays = self._arrays.get(seq)
        if arrays is None:
            arrays = self._arrays[seq] = _SeqArrays()
        return arrays

    def _prepare(
        self, seqs: list[Sequence], num_new_tokens: list[int], num_decodes: int, samples: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """input_ids, positions and the Context of one step, built with array ops."""
        assert self.config is not None, "allocate the cache first"
        bs = self.config.block_size
        num_seqs = len(seqs)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=num_seqs)
        lens = np.asarray(num_new_tokens, dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        input_ids = [s.token_ids[-1] for s in seqs[:num_decodes]]  # a decode runs its last token
        for s, c, n in zip(
            seqs[num_decodes:], starts[num_decodes:].tolist(), num_new_tokens[num_decodes:]
        ):
            input_ids += s.token_ids[c : c + n]
        if num_decodes == num_seqs:
            positions, seq_of_token = starts, np.arange(num_seqs)
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), lens)
            positions = np.arange(num_tokens) + (starts - query_start_loc[:-1])[seq_of_token]

        tables = [self._arrays_of(s).block_table(s) for s in seqs]
        block_tables = np.zeros((num_seqs, max(len(t) for t in tables)), dtype=np.int32)
        for row, table in zip(block_tables, tables):
            row[: len(table)] = table
        slot_mapping = (
            block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        )

        device = self.device

        def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

        logits_indices = query_start_loc[1:][np.asarray(samples, dtype=bool)] - 1
        seq_lens = starts + lens
        ctx = Context(
            query_start_loc=to_device(query_start_loc, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            slot_mapping=to_device(slot_mapping, torch.int64),
            block_tables=to_device(block_tables, torch.int32),
            state_indices=torch.tensor(
                [s.state_slot for s in seqs], dtype=torch.int64, device=device
            ),
            has_initial_state=to_device(starts > 0, torch.bool),
            num_decodes=num_decodes,
            logits_indices=to_device(logits_indices, torch.int64),
            query_start_loc_list=query_start_loc.tolist(),
            seq_lens_list=seq_lens.tolist(),
            all_slots_valid=bool((slot_mapping >= 0).all()),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        return ids, to_device(positions, torch.int64), ctx

    def _copy_states(self, copies) -> None:
        if copies:
            copy_state_slots(self.model, [c.src for c in copies], [c.dst for c in copies])

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        """Run one scheduled step; returns the sampled token per sequence of `batch.seqs`,
        None where the step does not reach the sequence's last token."""
        if self.config is None:
            raise RuntimeError("caches are not allocated: call allocate_caches first")
        seqs = batch.seqs
        if not seqs:
            return []
        samples = batch.samples
        input_ids, positions, ctx = self._prepare(
            seqs, batch.num_new_tokens, batch.num_decodes, samples
        )
        self._copy_states(batch.copies_before)
        graph = self.graphs.get(len(seqs)) if ctx.all_decodes and ctx.all_slots_valid else None
        logits: torch.Tensor | None
        if graph is not None and all(samples):
            logits = graph(input_ids, positions, ctx)
        else:
            set_context(ctx)
            try:
                hidden = self.model(input_ids, positions)
                logits = self.model.compute_logits(hidden) if ctx.logits_indices.numel() else None
            finally:
                reset_context()
        self._copy_states(batch.copies_after)
        if logits is None:
            return [None] * len(seqs)
        sampled = [s for s, sample in zip(seqs, samples) if sample]
        params = [s.sampling_params for s in sampled]
        histories = [
            self._arrays_of(s).token_ids(s) if s.sampling_params.repetition_penalty != 1 else None
            for s in sampled
        ]
        tokens = iter(
            self.sampler(
                logits,
                params,
                histories,
                [s.num_output_tokens for s in sampled],
                [s.constraint_state for s in sampled],
            )
        )
        return [next(tokens) if sample else None for sample in samples]
