"""Read-only sizes and switches of the engine core (scheduler, block manager, state slots)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Engine-core configuration; build it after measuring memory, then never change it.

    `num_kv_blocks` blocks of `block_size` tokens hold the KV of the full-attention layers.
    Hybrid models also keep linear-attention state in one slot tensor per layer: slots
    `[0, num_state_slots)` belong to live sequences, slots
    `[num_state_slots, num_state_slots + num_snapshot_slots)` keep prefix-cache snapshots.
    """

    vocab_size: int
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_num_waiting: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    is_hybrid: bool = False
    num_state_slots: int = 0  # hybrid only; 0 means max_num_seqs
    num_snapshot_slots: int = 0  # hybrid + prefix caching only
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if self.is_hybrid and self.num_state_slots == 0:
            object.__setattr__(self, "num_state_slots", self.max_num_seqs)
        for name in (
            "vocab_size",
            "max_model_len",
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_num_waiting",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be at least 1")
        if self.num_state_slots < 0 or self.num_snapshot_slots < 0:
            raise ValueError("EngineConfig state and snapshot slot counts must be >= 0")
        if not self.is_hybrid and (self.num_state_slots or self.num_snapshot_slots):
            raise ValueError("state and snapshot slots are for hybrid models only (is_hybrid)")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            # Guarantees that any request valid for max_model_len fits the pool on its own.
            raise ValueError(
                f"{self.num_kv_blocks} KV blocks of {self.block_size} tokens cannot hold one "
                f"sequence of max_model_len={self.max_model_len}: lower max_model_len or give "
                "the KV cache more memory"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode each)")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len"
            )
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError("EngineConfig.eos_token_ids must lie inside the vocabulary")

    @property
    def state_pool_size(self) -> int:
        """First dimension of every linear-attention state tensor: live plus snapshot slots."""
        return self.num_state_slots + self.num_snapshot_slots

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a padded block-table row."""
        return -(-self.max_model_len // self.block_size)
