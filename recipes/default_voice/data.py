"""Step 1: teacher audio -> trimmed log-mel plus per-character token durations, in resumable shards."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from recipes.default_voice import natural
from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.corpus import chinese_corpus, english_corpus, to_pinyin
from recipes.default_voice.teacher import (
    SAMPLE_RATE,
    EspeakLib,
    Utterance,
    durations_for,
    flite_synth,
    trim_bounds,
)

ESPEAK_VOICES = {"en": "en-us", "zh": "cmn-latn-pinyin"}
_worker: dict = {}


def espeak_phonemes(text: str, voice: str) -> str:
    """The text front end: `espeak-ng -q -x -v voice text`, clauses on separate lines."""
    out = subprocess.run(
        ["espeak-ng", "-q", "-x", "-v", voice, text], capture_output=True, text=True, check=True
    )
    return "\n".join(line.strip() for line in out.stdout.splitlines() if line.strip())


def teacher_mel(audio: np.ndarray) -> np.ndarray:
    if "mel" not in _worker:
        import torch

        torch.set_num_threads(1)
        from vocoder_service.checkpoint import resolve_checkpoint
        from vocoder_service.mel import MelSpectrogram

        _worker["mel"] = MelSpectrogram(resolve_checkpoint().config)
    return _worker["mel"](audio)[0].numpy()


def teacher_audio(text: str, lang: str) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    """Teacher waveform at 22050 Hz and its phones."""
    if lang == "en":
        return flite_synth(text)
    if "espeak" not in _worker:
        _worker["espeak"] = EspeakLib()
    return _worker["espeak"].synth(text, ESPEAK_VOICES[lang])


def make_utterance(item: tuple[str, str, int]) -> Utterance | None:
    """Synthesize, trim, compute log-mel and align durations for one sentence."""
    text, lang, frames_per_token = item
    try:
        audio, phones = teacher_audio(text, lang)
        units = espeak_phonemes(text, ESPEAK_VOICES[lang])
        start, end = trim_bounds(phones, len(audio))
        hop = 256
        num_tokens = (end - start) // (hop * frames_per_token)
        if num_tokens < 4 or not units:
            return None
        audio = audio[start : start + num_tokens * hop * frames_per_token]
        mel = teacher_mel(audio)[:, : num_tokens * frames_per_token]
        durations = durations_for(
            phones, units, start, num_tokens, lang == "en", hop * frames_per_token
        )
        return Utterance(text, units, durations.astype(np.int16), mel.astype(np.float16))
    except (subprocess.CalledProcessError, ValueError, IndexError) as exc:
        print(f"skip {text!r}: {exc}")
        return None


def sentences(cfg: RecipeConfig) -> dict[str, list[str]]:
    """Split name -> teacher texts. Training is mostly natural text (`natural.py`) with templates
    kept for numbers and money; its last sentences (the validation slice) are natural. Held-out
    sets: `*_eval` from the templates, `*_natural` from sources the training never reads."""
    en = english_corpus(cfg.en_train_templates + cfg.en_eval, seed=cfg.seed)
    zh = chinese_corpus(cfg.zh_train_templates + cfg.zh_eval, seed=cfg.seed + 1)
    en_nat = natural.english_training(cfg.en_train_natural, seed=cfg.seed)
    zh_nat = natural.chinese_training(cfg.zh_train_natural, seed=cfg.seed)
    rng = random.Random(cfg.seed)
    en_train = [t for t, _ in en[cfg.en_eval :]] + en_nat[:-100]
    zh_train = zh[cfg.zh_eval :] + zh_nat[:-40]
    rng.shuffle(en_train)
    rng.shuffle(zh_train)
    return {
        "en_train": en_train + en_nat[-100:],
        "zh_train": [to_pinyin(s) for s in zh_train + zh_nat[-40:]],
        "en_natural": natural.english_held_out(cfg.en_eval, seed=cfg.seed),
        "zh_natural": [to_pinyin(s) for s in natural.chinese_held_out(cfg.zh_eval, seed=cfg.seed)],
        "en_eval": [t for t, _ in en[: cfg.en_eval]],
        "zh_eval": [to_pinyin(s) for s in zh[: cfg.zh_eval]],
    }


def spoken_english(cfg: RecipeConfig) -> dict[str, str]:
    """Teacher text -> words as read aloud (numbers spelled out), for WER references; natural
    sentences hold no digits, so they read as written."""
    spoken = dict(english_corpus(cfg.en_train_templates + cfg.en_eval, seed=cfg.seed))
    for text in natural.english_held_out(cfg.en_eval, seed=cfg.seed):
        spoken.setdefault(text, text)
    return spoken


def build_teacher_data(cfg: RecipeConfig, shard_size: int = 500) -> None:
    """Write `teacher/<split>_<k>.pkl` shards; existing shards are kept."""
    out = cfg.cache / "teacher"
    out.mkdir(parents=True, exist_ok=True)
    workers = max(1, min(cfg.workers, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        for split, texts in sentences(cfg).items():
            lang = split[:2]
            for k in range(0, len(texts), shard_size):
                path = out / f"{split}_{k // shard_size:03d}.pkl"
                if path.exists():
                    continue
                items = [(t, lang, cfg.frames_per_token) for t in texts[k : k + shard_size]]
                utts = [u for u in pool.map(make_utterance, items, chunksize=8) if u is not None]
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(pickle.dumps(utts))
                tmp.rename(path)
                print(f"teacher {path.name}: {len(utts)} utterances", flush=True)


def load_split(cfg: RecipeConfig, split: str) -> list[Utterance]:
    """All utterances of one split, in corpus order."""
    utts: list[Utterance] = []
    for path in sorted((cfg.cache / "teacher").glob(f"{split}_*.pkl")):
        utts.extend(pickle.loads(path.read_bytes()))
    return utts


def seconds(utts: list[Utterance], frames_per_token: int) -> float:
    """Total audio duration of utterances."""
    return sum(int(u.durations.sum()) for u in utts) * frames_per_token * 256 / SAMPLE_RATE


def ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
