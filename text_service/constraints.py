"""Per-request decoding constraints, host side: their settings, validation and per-sequence state.

A constraint's state is a function of the request's output tokens alone and is advanced with
each token the sequence appends, so it follows the sequence through chunked prefill,
preemption by recompute (the output is kept) and prefix-cache hits (which only touch the
prompt). The sampler applies every row's constraint to the logits in one batched pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from text_service.errors import InvalidRequestError


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class PhonemeSync:
    """Phoneme-synchronous decoding: expected phonemes in order, each followed by speech tokens.

    The output is `p0 s.. p1 s.. ... p[n-1] s.. end`. At every step the probability mass of all
    non-speech ids is pooled onto the next expected id (the next phoneme, or `end_token_id`
    after the last one): any non-speech choice is a vote to move on, and it emits what comes
    next, so no phoneme can be skipped, repeated or reordered. Phoneme i is followed by at least
    `min_tokens[i]` and at most `max_tokens[i]` speech tokens: below the minimum only speech
    tokens can be drawn, at the maximum the advance is forced. A duration schedule is
    min == max; a cap alone is min 0.
    """

    phoneme_ids: tuple[int, ...]
    speech_token_range: tuple[int, int]  # inclusive [lo, hi]: the acoustic ids
    end_token_id: int
    min_tokens: tuple[int, ...]
    max_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("phoneme_ids", "speech_token_range", "min_tokens", "max_tokens"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def with_cap(cls, phoneme_ids, speech_token_range, end_token_id: int, cap: int) -> PhonemeSync:
        """The same cap after every phoneme and no minimum."""
        n = len(tuple(phoneme_ids))
        return cls(tuple(phoneme_ids), speech_token_range, end_token_id, (0,) * n, (cap,) * n)

    @property
    def min_output_tokens(self) -> int:
        """The fewest tokens a finished output holds: phonemes, minimum speech tokens, end."""
        return len(self.phoneme_ids) + sum(self.min_tokens) + 1

    def validate(self, vocab_size: int, max_tokens: int, field: str = "phoneme_sync") -> None:
        """Raise InvalidRequestError naming the first sub-field that breaks a rule."""
        n = len(self.phoneme_ids)
        if n == 0:
            raise InvalidRequestError(f"{field}.phoneme_ids", "must not be empty")
        r = self.speech_token_range
        if len(r) != 2 or not all(_is_int(x) for x in r) or not 0 <= r[0] <= r[1] < vocab_size:
            raise InvalidRequestError(
                f"{field}.speech_tokens",
                f"must be a range [lo, hi] with 0 <= lo <= hi < {vocab_size}",
            )
        lo, hi = r
        for t in self.phoneme_ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise InvalidRequestError(
                    f"{field}.phoneme_ids", f"id {t!r} is outside the vocabulary [0, {vocab_size})"
                )
            if lo <= t <= hi:
                raise InvalidRequestError(
                    f"{field}.phoneme_ids", f"id {t} lies in speech_tokens [{lo}, {hi}]"
                )
        e = self.end_token_id
        if not _is_int(e) or not 0 <= e < vocab_size or lo <= e <= hi:
            raise InvalidRequestError(
                f"{field}.end_token_id", f"must be an id in [0, {vocab_size}) outside speech_tokens"
            )
        for name in ("min_tokens", "max_tokens"):
            values = getattr(self, name)
            if len(values) != n:
                raise InvalidRequestError(
                    f"{field}.{name}", f"needs one value per phoneme ({n}), got {len(values)}"
                )
            if any(not _is_int(v) or v < 0 for v in values):
                raise InvalidRequestError(f"{field}.{name}", "values must be integers >= 0")
        if any(a > b for a, b in zip(self.min_tokens, self.max_tokens)):
            raise InvalidRequestError(f"{field}.min_tokens", "must not exceed max_tokens")
        if sum(self.max_tokens) == 0:
            raise InvalidRequestError(f"{field}.max_tokens", "allows no speech token at all")
        if self.min_output_tokens > max_tokens:
            raise InvalidRequestError(
                "max_tokens",
                f"{max_tokens} cannot hold the constrained output, which needs at "
                f"least {self.min_output_tokens} tokens",
            )

    def initial_state(self) -> PhonemeSyncState:
        return PhonemeSyncState()


@dataclass
class PhonemeSyncState:
    """Where a sequence stands: phonemes emitted so far and speech tokens since the last one."""

    num_phonemes: int = 0
    run: int = 0

    def advance(self, c: PhonemeSync, token_id: int) -> None:
        """Account for one output token."""
        lo, hi = c.speech_token_range
        if lo <= token_id <= hi:
            self.run += 1
        elif (
            self.num_phonemes < len(c.phoneme_ids) and token_id == c.phoneme_ids[self.num_phonemes]
        ):
            self.num_phonemes += 1
            self.run = 0

    def next_id(self, c: PhonemeSync) -> int:
        """The id a vote to move on emits."""
        return self.row(c)[0]

    def bounds(self, c: PhonemeSync) -> tuple[bool, bool]:
        """(may advance, must advance) at this step."""
        return self.row(c)[1:]

    def row(self, c: PhonemeSync) -> tuple[int, bool, bool]:
        """(next id, may advance, must advance): all the sampler needs of this row, in one call."""
        k = self.num_phonemes
        if k == 0:
            return c.phoneme_ids[0], True, True  # the output opens with the first phoneme
        nxt = c.phoneme_ids[k] if k < len(c.phoneme_ids) else c.end_token_id
        return nxt, self.run >= c.min_tokens[k - 1], self.run >= c.max_tokens[k - 1]
