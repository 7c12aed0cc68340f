"""Per-step attention metadata shared by every layer of the model."""

from dataclasses import dataclass
from functools import cached_property

from torch import Tensor


@dataclass
class Context:
    """What one model step needs besides token ids and positions.

    Sequences are ordered decodes first: the first ``num_decodes`` sequences have exactly one
    new token each, the rest are prefill chunks.
    """

    query_start_loc: Tensor  # int32 [B+1] cumulative new-token counts
    seq_lens: Tensor  # int32 [B] KV length after this step (cached + new)
    slot_mapping: Tensor  # int64 [T] KV slot of each new token (< 0: skip)
    block_tables: Tensor  # int32 [B, max_blocks]
    state_indices: Tensor  # int64 [B] slot of each sequence in the linear-attention state pools
    has_initial_state: Tensor  # bool [B] False on a sequence's first chunk
    num_decodes: int
    logits_indices: Tensor  # int64 [n] rows of the hidden states to turn into logits
    # Host copies of the metadata that device kernels take as host arguments (vllm-ascend's
    # seq_lens_list), built once per step so that no layer reads a device tensor back.
    # None where the builder did not provide them: the kernels then read the device tensors.
    query_start_loc_list: list[int] | None = None
    seq_lens_list: list[int] | None = None
    all_slots_valid: bool | None = None  # every slot_mapping entry >= 0

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def all_decodes(self) -> bool:
        return self.num_decodes == self.num_seqs

    @cached_property
    def prefill_query_start_loc(self) -> Tensor:
        """query_start_loc of the prefill sequences alone, counted from their first token."""
        if self.num_decodes == 0:
            return self.query_start_loc
        return self.query_start_loc[self.num_decodes :] - self.num_decodes

    @cached_property
    def prefill_query_start_loc_list(self) -> list[int] | None:
        """Host copy of `prefill_query_start_loc` (None without `query_start_loc_list`)."""
        if self.query_start_loc_list is None:
            return None
        nd = self.num_decodes
        return [start - nd for start in self.query_start_loc_list[nd:]]

    @cached_property
    def decode_seq_lens_list(self) -> list[int] | None:
        """`seq_lens_list` of the decode sequences (None without it)."""
        return None if self.seq_lens_list is None else self.seq_lens_list[: self.num_decodes]

    @cached_property
    def prefill_seq_lens_list(self) -> list[int] | None:
        """`seq_lens_list` of the prefill sequences (None without it)."""
        return None if self.seq_lens_list is None else self.seq_lens_list[self.num_decodes :]


_CONTEXT: Context | None = None


def set_context(ctx: Context) -> None:
    """Install the metadata of the step about to run."""
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> Context:
    """The metadata of the running step; raises if none was set."""
    if _CONTEXT is None:
        raise RuntimeError("no step context is set: call set_context() before running the model")
    return _CONTEXT


def reset_context() -> None:
    """Forget the step's metadata (after the step)."""
    global _CONTEXT
    _CONTEXT = None
