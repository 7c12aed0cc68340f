"""Per-request sampling settings and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass

from text_service.constraints import PhonemeSync
from text_service.errors import InvalidRequestError

_MAX_SEED = 2**64


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: every knob has an "off" value, as in vLLM.

    temperature 0 is greedy; top_k 0, top_p 1 and repetition_penalty 1 are off. The penalty
    applies to the distinct ids among the last `repetition_window` tokens of prompt + output
    (0: all of them). `allowed_token_range` is an inclusive [lo, hi] id range (e.g. speech
    tokens only); the sampler masks every id outside it except `exempt_token_ids(eos)`.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    allowed_token_range: tuple[int, int] | None = None
    phoneme_sync: PhonemeSync | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the object hashable and immutable.
        stops = tuple(self.stop_token_ids)
        if self.phoneme_sync is not None and self.phoneme_sync.end_token_id not in stops:
            stops += (self.phoneme_sync.end_token_id,)
        object.__setattr__(self, "stop_token_ids", stops)
        if self.allowed_token_range is not None:
            object.__setattr__(self, "allowed_token_range", tuple(self.allowed_token_range))

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0

    def exempt_token_ids(self, eos_token_ids: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Ids allowed outside `allowed_token_range`: stop ids and, unless ignored, EOS."""
        extra = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys(self.stop_token_ids + extra))

    def validate(
        self,
        vocab_size: int,
        max_model_len: int,
        prompt_len: int,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """Raise InvalidRequestError naming the first field that breaks a rule."""
        if prompt_len < 1:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        if prompt_len >= max_model_len:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"prompt of {prompt_len} tokens leaves no room to generate under "
                f"max_model_len={max_model_len}",
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", "must be an integer of at least 1")
        if prompt_len + self.max_tokens > max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({self.max_tokens}) exceeds "
                f"max_model_len={max_model_len}; lower max_tokens to at most "
                f"{max_model_len - prompt_len}",
            )
        # Bounds that keep logits finite: a tiny temperature or penalty scales them to inf.
        if not _is_number(self.temperature) or not (
            self.temperature == 0 or self.temperature >= 1e-4
        ):
            raise InvalidRequestError(
                "temperature", "must be 0 (greedy) or a finite number >= 0.0001"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError("top_k", "must be an integer >= 0 (0 = off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", "must lie in (0, 1] (1 = off)")
        if not _is_number(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            raise InvalidRequestError("repetition_penalty", "must lie in [0.01, 100] (1 = off)")
        if not _is_int(self.repetition_window) or self.repetition_window < 0:
            raise InvalidRequestError("repetition_window", "must be an integer >= 0 (0 = all)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _MAX_SEED):
            raise InvalidRequestError("seed", "must be an integer in [0, 2**64)")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise InvalidRequestError(
                    "stop_token_ids", f"id {t!r} is outside the vocabulary [0, {vocab_size})"
                )
        if self.allowed_token_range is not None:
            r = self.allowed_token_range
            if len(r) != 2 or not all(_is_int(x) for x in r):
                raise InvalidRequestError("allowed_token_range", "must be two integers [lo, hi]")
            lo, hi = r
            if not 0 <= lo <= hi < vocab_size:
                raise InvalidRequestError(
                    "allowed_token_range",
                    f"[{lo}, {hi}] must satisfy 0 <= lo <= hi < vocab_size ({vocab_size})",
                )
        if self.phoneme_sync is not None:
            c = self.phoneme_sync
            c.validate(vocab_size, self.max_tokens)
            ends = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
            clash = next((t for t in c.phoneme_ids if t in ends), None)
            if clash is not None:
                raise InvalidRequestError(
                    "phoneme_sync.phoneme_ids", f"id {clash} is a stop or end-of-sequence id"
                )
