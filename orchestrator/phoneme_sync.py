"""Phoneme-synchronous requests for voices whose LM writes each phoneme back before its sound.

A voice declares it in `voice.json`:

    "phoneme_sync": {"max_tokens_per_phoneme": 8, "durations": "durations/duration_predictor.safetensors",
                     "band": [1.0, 1.0]}

The planner tokenises a segment's prompt with the voice's own `lm/tokenizer.json`, takes the
phoneme characters' ids as the expected sequence, and (with a predictor) bounds each phoneme's
speech tokens to `band` times its predicted duration: [1, 1] is a forced schedule, a wider band
lets the model's vote decide inside it. Without a predictor every phoneme gets
[min_tokens_per_phoneme (default 0), max_tokens_per_phoneme] speech tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.durations import DurationPredictor, schedule


@dataclass(frozen=True)
class SyncPlan:
    """What one segment's Generate call sends, and what reading its output needs."""

    prompt_ids: list[int]
    phoneme_ids: list[int]
    phoneme_chars: str  # the characters the ids stand for, one each
    min_tokens: list[int]
    max_tokens: list[int]

    @property
    def max_output_tokens(self) -> int:
        return len(self.phoneme_ids) + sum(self.max_tokens) + 1


class SyncPlanner:
    """Builds a segment's SyncPlan from the LM's tokenizer, a cap and a duration predictor."""

    def __init__(
        self,
        tokenizer_path: Path,
        prompt_template: str,
        cap: int = 8,
        band: tuple[float, float] = (1.0, 1.0),
        predictor_path: Path | None = None,
        floor: int = 0,
    ):
        from tokenizers import Tokenizer

        if not Path(tokenizer_path).is_file():
            raise ValueError(f"phoneme_sync needs the LM's tokenizer: {tokenizer_path} is missing")
        if cap < 1 or not 0 <= band[0] <= band[1] or not 0 <= floor <= cap:
            raise ValueError(
                "phoneme_sync needs max_tokens_per_phoneme >= 1, a band [lo, hi] "
                "with 0 <= lo <= hi and 0 <= min_tokens_per_phoneme <= the cap"
            )
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.prompt_template = prompt_template
        self.cap, self.band, self.floor = int(cap), (float(band[0]), float(band[1])), int(floor)
        self.predictor = DurationPredictor.load(predictor_path) if predictor_path else None

    @classmethod
    def for_voice(cls, voice_dir: Path, prompt_template: str, config: dict) -> SyncPlanner:
        """From a voice manifest's `phoneme_sync` entry."""
        band = config.get("band", [1.0, 1.0])
        weights = config.get("durations")
        return cls(
            voice_dir / "lm" / "tokenizer.json",
            prompt_template,
            int(config.get("max_tokens_per_phoneme", 8)),
            (float(band[0]), float(band[1])),
            voice_dir / weights if weights else None,
            int(config.get("min_tokens_per_phoneme", 0)),
        )

    @property
    def schedules_rate(self) -> bool:
        """True when the durations are forced (band [x, x]): the speaking rate then scales them
        before synthesis; otherwise the model's vote sets the tempo and the audio is stretched."""
        return self.predictor is not None and self.band[0] == self.band[1]

    def plan(self, model_input: str, speaking_rate: float = 1.0) -> SyncPlan | None:
        """The plan of one segment; None when its prompt does not hold its phonemes one per id."""
        text = self.tokenizer.encode(model_input, add_special_tokens=False)
        prompt = self.tokenizer.encode(
            self.prompt_template.replace("{text}", model_input), add_special_tokens=False
        ).ids
        ids = text.ids
        chars = (
            self.tokenizer.normalizer.normalize_str(model_input)
            if self.tokenizer.normalizer
            else model_input
        )
        n = len(ids)
        inner = next((i for i in range(len(prompt) - n + 1) if prompt[i : i + n] == ids), None)
        if n == 0 or len(chars) != n or inner is None:
            return None
        if self.predictor is None:
            lo, hi = [self.floor] * n, [self.cap] * n
        else:
            lo, hi = schedule(self.predictor(ids), self.band, self.cap, speaking_rate)
        return SyncPlan(prompt, ids, chars, lo, hi)
