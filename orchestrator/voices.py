"""Voice manifests (`voices/<name>/voice.json`) as the orchestrator needs them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

VOICES_DIR = Path(__file__).resolve().parents[1] / "voices"


@dataclass(frozen=True)
class VoiceSpec:
    """What turning text into a prompt and tokens into audio needs to know about a voice."""

    name: str
    directory: Path
    description: str
    languages: tuple[str, ...]
    sample_rate: int
    speech_token_range: tuple[int, int]  # inclusive LM ids; codebook index = id - start
    end_token_id: int
    prompt_template: str
    text_frontend: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    allowed_token_range: tuple[int, int] | None = None
    max_tokens: int = 1200
    max_tokens_per_char: float = 0.0  # 0: only max_tokens caps a segment
    samples_per_token: int = 512  # hop_size * frames_per_token: a speech token's audio
    phoneme_sync: dict | None = None  # orchestrator.phoneme_sync: the LM writes phonemes back

    @classmethod
    def load(cls, directory: str | Path) -> VoiceSpec:
        directory = Path(directory)
        path = directory / "voice.json"
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{directory} is not a voice: voice.json is missing") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        try:
            lo, hi = (int(x) for x in m["speech_token_range"])
            allowed = m.get("allowed_token_range")
            if allowed is not None and len(allowed) != 2:
                raise ValueError("allowed_token_range: must be [start, end]")
            spec = cls(
                name=str(m.get("name", directory.name)),
                directory=directory,
                description=str(m.get("description", "")),
                languages=tuple(m.get("languages") or ("en-US",)),
                sample_rate=int(m["sample_rate"]),
                speech_token_range=(lo, hi),
                end_token_id=int(m["end_token_id"]),
                prompt_template=str(m.get("prompt_template", "{text}")),
                text_frontend=dict(m.get("text_frontend") or {}),
                sampling=dict(m.get("sampling") or {}),
                allowed_token_range=(int(allowed[0]), int(allowed[1])) if allowed else None,
                max_tokens=int(m.get("max_tokens", 1200)),
                max_tokens_per_char=float(
                    m.get("max_tokens_per_char", m.get("max_tokens_per_phoneme_char", 0.0))
                ),
                samples_per_token=int(m.get("hop_size", 256)) * int(m.get("frames_per_token", 1)),
                phoneme_sync=dict(m["phoneme_sync"]) if m.get("phoneme_sync") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: bad or missing field ({exc})") from None
        if "{text}" not in spec.prompt_template:
            raise ValueError(f"{path}: prompt_template must contain {{text}}")
        if not 0 <= lo <= hi:
            raise ValueError(f"{path}: speech_token_range must be [start, end] with start <= end")
        return spec

    def is_speech(self, token_id: int) -> bool:
        lo, hi = self.speech_token_range
        return lo <= token_id <= hi

    def language_for(self, code: str) -> str | None:
        """The voice's language matching a BCP-47 code (exact, then by primary subtag)."""
        if not code:
            return self.languages[0]
        for lang in self.languages:
            if lang.lower() == code.lower():
                return lang
        primary = code.split("-")[0].lower()
        aliases = {"zh": "cmn", "cmn": "cmn"}
        for lang in self.languages:
            if aliases.get(lang.split("-")[0].lower(), lang.split("-")[0].lower()) == aliases.get(
                primary, primary
            ):
                return lang
        return None


def discover(paths: list[str | Path] | None = None) -> list[VoiceSpec]:
    """Voices from explicit directories, else every folder under voices/ ("default" first)."""
    if paths:
        return [VoiceSpec.load(p) for p in paths]
    found = (
        sorted(
            (d for d in VOICES_DIR.iterdir() if (d / "voice.json").is_file()),
            key=lambda d: (d.name != "default", d.name),
        )
        if VOICES_DIR.is_dir()
        else []
    )
    return [VoiceSpec.load(d) for d in found]
