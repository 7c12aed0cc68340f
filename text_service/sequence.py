"""One request as the engine core sees it: its tokens, progress, cache blocks and state slot."""

from __future__ import annotations

from enum import Enum, auto
from typing import Literal

from text_service.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(Enum):
    WAITING = auto()  # queued, holds no blocks and no state slot
    RUNNING = auto()  # admitted: holds blocks (and a state slot on hybrid models)
    FINISHED = auto()  # done or aborted; everything released


class Sequence:
    """A request: prompt + output token ids and how far the model has computed them.

    `num_computed_tokens` counts tokens whose KV (and linear-attention state) is in the cache;
    the model still has to run `token_ids[num_computed_tokens:]`. The scheduler only changes it
    in `postprocess` (after the step) and on preemption, so during a step the model runner reads
    it as the position of the step's first new token. Time fields are plain floats for the
    caller to fill in; the core never reads a clock.
    """

    def __init__(
        self,
        seq_id: str | int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float = 0.0,
    ):
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit of the latest admission
        self.num_scheduled_tokens = 0  # new tokens in the step being run, 0 between steps
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled lazily
        self.state_slot = -1  # live linear-attention state slot, -1 when none
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None  # the EOS / stop id that finished it, if any
        self.num_preemptions = 0
        # decoding-constraint state: a function of the output alone, so recompute keeps it
        sync = self.sampling_params.phoneme_sync
        self.constraint_state = sync.initial_state() if sync is not None else None
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.prefill_done_time: float | None = None  # prompt fully computed (first admission)
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (a stop token that finished it included)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while more than the last token remains to compute (first run or recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        """Add one sampled token."""
        self.token_ids.append(token_id)
        sync = self.sampling_params.phoneme_sync
        if self.constraint_state is not None and sync is not None:
            self.constraint_state.advance(sync, token_id)
