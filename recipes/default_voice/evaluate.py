"""Step 5: held-out evaluation of the voice against its teachers, written as JSON and a Markdown table."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.data import load_split, spoken_english, teacher_audio
from recipes.default_voice.lm import EOS, PAD, edit_distance, max_new_tokens, prompt_ids, split_stream
from recipes.default_voice.metrics import Recognizer, dnsmos, mcd, word_errors, write_arpa
from recipes.default_voice.teacher import SAMPLE_RATE, trim_bounds
from recipes.default_voice.tokens import load_codes, load_decoder


@torch.no_grad()
def generate_batch(model, phonemes: list[str], cfg: RecipeConfig, temperature: float, top_k: int,
                   seed: int, batch: int = 25) -> list[list[int]]:
    """Free-running generation, left-padded batches (padding is masked in every layer)."""
    out: list[list[int]] = []
    order = sorted(range(len(phonemes)), key=lambda i: len(phonemes[i]))
    results: dict[int, list[int]] = {}
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        prompts = [prompt_ids(phonemes[i]) for i in idx]
        width = max(map(len, prompts))
        ids = torch.full((len(idx), width), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        cap = max(max_new_tokens(phonemes[i], cfg) for i in idx)
        kwargs = {"do_sample": temperature > 0}
        if temperature > 0:
            torch.manual_seed(seed + start)
            kwargs.update(temperature=temperature, top_k=top_k, top_p=1.0)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cap, eos_token_id=EOS,
                             pad_token_id=PAD, **kwargs)[:, width:]
        for r, i in enumerate(idx):
            stream = gen[r].tolist()
            own_cap = max_new_tokens(phonemes[i], cfg)
            if EOS in stream[:own_cap]:
                stream = stream[:stream.index(EOS) + 1]
            else:
                stream = stream[:own_cap]  # what a request with its own cap would have produced
            results[i] = stream
    for i in range(len(phonemes)):
        out.append(results[i])
    return out


def vocode(codes: np.ndarray, decoder, backend) -> tuple[np.ndarray, np.ndarray]:
    """Codes -> (decoder log-mel, waveform at 22050 Hz)."""
    mel = decoder.decode(np.asarray(codes, dtype=np.int64))
    return mel, backend.run(mel[None])[0]


def to16k(audio: np.ndarray) -> np.ndarray:
    import soxr

    return soxr.resample(audio.astype(np.float32), SAMPLE_RATE, 16000)


def score(wav: np.ndarray, u, lang: str, mel_fn, asr, spoken: dict[str, str] | None,
          with_mcd: bool = True) -> dict:
    """DNSMOS, MCD against the teacher's mel and (English) recognition of one waveform."""
    a16 = to16k(wav)
    row = {"dnsmos": dnsmos(a16)}
    if with_mcd:
        row["mcd"] = mcd(mel_fn(wav)[0].numpy(), u.mel.astype(np.float32))
    if lang == "en":
        row["hyp"] = asr(a16)
        row["errors"], row["ref_words"] = word_errors(spoken[u.text], row["hyp"])
    return row


def teacher_rows(cfg: RecipeConfig, lang: str, utts: list, codes: list, decoder, backend, mel_fn, asr,
                 spoken: dict[str, str]) -> dict[str, list[dict]]:
    """Scores of the teacher's audio and of its own tokens vocoded, cached (they do not depend on the LM)."""
    path = cfg.cache / f"eval_teacher_{lang}_{len(utts)}.json"
    if path.exists():
        return json.loads(path.read_text())
    rows: dict[str, list[dict]] = {"teacher audio": [], "teacher tokens": []}
    for k, u in enumerate(utts):
        audio, phones = teacher_audio(u.text, lang)
        s, e = trim_bounds(phones, len(audio))
        rows["teacher audio"].append(score(audio[s:e], u, lang, mel_fn, asr, spoken, with_mcd=False))
        _, taudio = vocode(codes[k], decoder, backend)
        rows["teacher tokens"].append(score(taudio, u, lang, mel_fn, asr, spoken))
    path.write_text(json.dumps(rows))
    return rows


def evaluate(cfg: RecipeConfig, lm_dir: Path | None = None, temperature: float | None = None, top_k: int = 50,
             n_audio_en: int = 150, n_audio_zh: int = 20, tag: str = "", teacher_only: bool = False) -> dict:
    """Score the LM in `lm_dir` (default: the best training checkpoint) and write `eval/`."""
    from transformers import AutoModelForCausalLM
    from transformers import logging as hf_logging

    from vocoder_service.backends import TorchBackend
    from vocoder_service.mel import MelSpectrogram

    hf_logging.set_verbosity_error()
    torch.set_num_threads(cfg.threads)
    temperature = cfg.temperature if temperature is None else temperature
    lm_dir = lm_dir or cfg.cache / "lm" / "best"
    out_dir = cfg.cache / f"eval{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    model = None if teacher_only else AutoModelForCausalLM.from_pretrained(lm_dir).eval()
    decoder = load_decoder(cfg)
    backend = TorchBackend()
    mel_fn = MelSpectrogram(backend.config)
    codes = load_codes(cfg)
    spoken = spoken_english(cfg)
    en_eval, zh_eval = load_split(cfg, "en_eval"), load_split(cfg, "zh_eval")
    lm_path = out_dir / "eval_en.arpa"
    write_arpa([spoken[u.text] for u in en_eval], lm_path)
    asr = Recognizer(lm_path)
    if teacher_only:
        for lang, utts, n in (("en", en_eval, n_audio_en), ("zh", zh_eval, n_audio_zh)):
            teacher_rows(cfg, lang, utts[:n], codes[f"{lang}_eval"], decoder, backend, mel_fn, asr, spoken)
        return {}
    report: dict = {"lm_dir": str(lm_dir), "temperature": temperature, "top_k": top_k, "rows": []}
    samples: dict[str, np.ndarray] = {}
    for lang, utts, n_audio in (("en", en_eval, n_audio_en), ("zh", zh_eval, n_audio_zh)):
        t0 = time.time()
        streams = generate_batch(model, [u.phonemes for u in utts], cfg, temperature, top_k, cfg.seed)
        gen_s = time.time() - t0
        parsed = [split_stream(s) for s in streams]
        runaway = sum(not stopped for _, _, stopped in parsed)
        ratios = [len(c) / max(1, int(u.durations.sum())) for u, (_, c, _) in zip(utts, parsed)]
        truncated = sum(stopped and r < 0.6 for (_, _, stopped), r in zip(parsed, ratios))
        cer = float(np.mean([edit_distance(ch, u.phonemes) / len(u.phonemes) for u, (ch, _, _) in zip(utts, parsed)]))
        rows = {**teacher_rows(cfg, lang, utts[:n_audio], codes[f"{lang}_eval"], decoder, backend, mel_fn, asr,
                               spoken), "voice": []}
        for k, u in enumerate(utts[:n_audio]):
            gen_codes = parsed[k][1]
            if len(gen_codes) < 2:
                gen_codes = [0, 0]
            _, vaudio = vocode(gen_codes, decoder, backend)
            if k == 0:
                samples[f"{lang}_voice"] = vaudio
            rows["voice"].append(score(vaudio, u, lang, mel_fn, asr, spoken))
        for name, rs in rows.items():
            entry = {"lang": lang, "system": name, "n": len(rs),
                     "dnsmos": float(np.mean([r["dnsmos"] for r in rs]))}
            if name != "teacher audio":
                entry["mcd_db"] = float(np.mean([r["mcd"] for r in rs]))
            if lang == "en":
                entry["wer"] = sum(r["errors"] for r in rs) / max(1, sum(r["ref_words"] for r in rs))
            if name == "voice":
                entry.update(n_generated=len(utts), duration_ratio=float(np.mean(ratios)), runaway=runaway,
                             truncated=truncated, phoneme_copy_cer=cer, generation_s=gen_s)
            report["rows"].append(entry)
            print(json.dumps(entry), flush=True)
        (out_dir / f"hyps_{lang}.json").write_text(json.dumps(
            [{"text": u.text, **r} for u, r in zip(utts, rows["voice"])], indent=1, ensure_ascii=False))
    import soundfile as sf

    for name, wav in samples.items():  # the first held-out sentence of each language
        sf.write(str(out_dir / f"{name}.wav"), wav, SAMPLE_RATE)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "table.md").write_text(table(report))
    print(table(report))
    return report


def table(report: dict) -> str:
    """The evaluation as a Markdown table."""
    lines = ["| language | system | n | WER | DNSMOS | MCD (dB) | duration ratio | phoneme-copy error | runaway | truncated |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        def f(key: str, fmt: str) -> str:
            return format(r[key], fmt) if key in r else "-"
        runaway = f"{r['runaway']}/{r['n_generated']}" if "runaway" in r else "-"
        truncated = f"{r['truncated']}/{r['n_generated']}" if "truncated" in r else "-"
        lines.append(f"| {r['lang']} | {r['system']} | {r['n']} | {f('wer', '.1%')} | {f('dnsmos', '.2f')} | "
                     f"{f('mcd_db', '.2f')} | {f('duration_ratio', '.2f')} | {f('phoneme_copy_cer', '.1%')} | {runaway} | "
                     f"{truncated} |")
    return "\n".join(lines) + "\n"
