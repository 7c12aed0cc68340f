"""What every causal LM here shares: embeddings, LM head (tied or not), logits, cache layout."""

from typing import Any

import torch
from torch import Tensor, nn

from text_service.context import get_context
from text_service.models.cache import KVCacheSpec, LinearStateSpec
from text_service.models.layers import Linear, PagedAttention


class CausalLM(nn.Module):
    """Base of the ``*ForCausalLM`` classes; subclasses build ``self.model`` (embed_tokens, layers, norm).

    Checkpoint naming, declared once per class:
    ``packed_modules_mapping``: checkpoint module name -> (fused module name, shard index);
    ``checkpoint_renames``: checkpoint name prefix -> our prefix;
    ``ignored_checkpoint_prefixes``: checkpoint tensors this text-only model deliberately skips.
    """

    packed_modules_mapping: dict[str, tuple[str, int]] = {}
    checkpoint_renames: dict[str, str] = {}
    ignored_checkpoint_prefixes: tuple[str, ...] = ()
    model: Any  # built by the subclass: embed_tokens, layers, norm, ops

    def __init__(self, config, ops) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, ops=ops)
        self._tied_head: Tensor | None = None  # the embeddings in the LM head's layout, once packed

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """input_ids/positions [T] of all sequences in the step -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits [n, vocab] of the rows ``get_context().logits_indices`` of ``hidden``."""
        hidden = hidden[get_context().logits_indices]
        if self.tie_word_embeddings:
            weight = self.model.embed_tokens.weight if self._tied_head is None else self._tied_head
        else:
            weight = self.lm_head.weight
        return self.model.ops.linear(hidden, weight).float()

    def pack_weights(self) -> None:
        """Put every projection in `ops.pack_linear_weight`'s layout, once, after loading (a tied
        LM head gets its own copy; the embedding lookup keeps the table)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight()
        if self.tie_word_embeddings:
            packed = self.model.ops.pack_linear_weight(self.model.embed_tokens.weight)
            self._tied_head = None if packed is self.model.embed_tokens.weight else packed

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def attention_layers(self) -> dict[int, PagedAttention]:
        """Layer index -> module that holds ``k_cache``/``v_cache`` (full-attention layers)."""
        return {
            i: layer.self_attn.attn
            for i, layer in enumerate(self.model.layers)
            if hasattr(layer, "self_attn")
        }

    def linear_attention_layers(self) -> dict[int, Any]:  # Gated DeltaNet mixers
        """Layer index -> module that holds ``conv_state``/``ssm_state`` (Gated DeltaNet layers)."""
        return {
            i: layer.linear_attn
            for i, layer in enumerate(self.model.layers)
            if hasattr(layer, "linear_attn")
        }

    def kv_cache_specs(self) -> dict[int, KVCacheSpec]:
        """Layer index -> KV pool layout, for every full-attention layer."""
        return {i: attn.kv_cache_spec(self.dtype) for i, attn in self.attention_layers().items()}

    def state_specs(self) -> dict[int, LinearStateSpec]:
        """Layer index -> state pool layout, for every linear-attention layer."""
        return {
            i: mixer.state_spec(self.dtype) for i, mixer in self.linear_attention_layers().items()
        }
