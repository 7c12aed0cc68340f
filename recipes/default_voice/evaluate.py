"""Step 5: held-out evaluation of the voice against its teachers, written as JSON and a Markdown table."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.data import load_split, spoken_english, teacher_audio
from recipes.default_voice.lm import edit_distance, normalize_phonemes, split_stream
from recipes.default_voice.metrics import Recognizer, dnsmos, mcd, word_errors, write_arpa
from recipes.default_voice.synth import CANDIDATES, Decoding, decode
from recipes.default_voice.teacher import SAMPLE_RATE, trim_bounds
from recipes.default_voice.tokens import load_decoder, split_codes


def vocode(codes: np.ndarray, decoder, backend) -> tuple[np.ndarray, np.ndarray]:
    """Codes -> (decoder log-mel, waveform at 22050 Hz)."""
    mel = decoder.decode(np.asarray(codes, dtype=np.int64))
    return mel, backend.run(mel[None])[0]


def to16k(audio: np.ndarray) -> np.ndarray:
    import soxr

    return soxr.resample(audio.astype(np.float32), SAMPLE_RATE, 16000)


def score(
    wav: np.ndarray, u, lang: str, mel_fn, asr, spoken: dict[str, str] | None, with_mcd: bool = True
) -> dict:
    """DNSMOS, MCD against the teacher's mel and (English) recognition of one waveform."""
    a16 = to16k(wav)
    row = {"dnsmos": dnsmos(a16)}
    if with_mcd:
        row["mcd"] = mcd(mel_fn(wav)[0].numpy(), u.mel.astype(np.float32))
    if lang == "en":
        row["hyp"] = asr(a16)
        row["errors"], row["ref_words"] = word_errors(spoken[u.text], row["hyp"])
    return row


def teacher_rows(
    cfg: RecipeConfig,
    lang: str,
    name: str,
    utts: list,
    codes: list,
    decoder,
    backend,
    mel_fn,
    asr,
    spoken: dict[str, str],
) -> dict[str, list[dict]]:
    """Scores of the teacher's audio and of its own tokens vocoded, cached (they do not depend on the LM)."""
    path = cfg.cache / f"eval_teacher_{name}_{len(utts)}.json"
    if path.exists():
        return json.loads(path.read_text())
    rows: dict[str, list[dict]] = {"teacher audio": [], "teacher tokens": []}
    for k, u in enumerate(utts):
        audio, phones = teacher_audio(u.text, lang)
        s, e = trim_bounds(phones, len(audio))
        rows["teacher audio"].append(
            score(audio[s:e], u, lang, mel_fn, asr, spoken, with_mcd=False)
        )
        _, taudio = vocode(codes[k], decoder, backend)
        rows["teacher tokens"].append(score(taudio, u, lang, mel_fn, asr, spoken))
    path.write_text(json.dumps(rows))
    return rows


def _spoken_of(cfg: RecipeConfig, utts) -> dict[str, str]:
    spoken = spoken_english(cfg)
    return {u.text: spoken.get(u.text, u.text) for u in utts}


def score_decoding(
    cfg: RecipeConfig,
    lm_dir: Path,
    decoding: Decoding,
    sets: list[tuple[str, str, list]],
    tools: dict,
    n_audio: dict[str, int],
    with_teacher: bool = True,
) -> tuple[list[dict], dict]:
    """Decode and score each (lang, name, utterances) set; rows of the table and per-sentence hyps."""
    rows, hyps = [], {}
    for lang, name, utts in sets:
        t0 = time.time()
        streams = decode(
            cfg,
            lm_dir,
            [u.phonemes for u in utts],
            decoding,
            teacher_durations=[u.durations for u in utts],
            predictor=tools["predictor"],
        )
        gen_s = time.time() - t0
        parsed = [split_stream(st) for st in streams]
        ratios = np.array(
            [len(c) / max(1, int(u.durations.sum())) for u, (_, c, _) in zip(utts, parsed)]
        )
        runaway = sum(not stopped for _, _, stopped in parsed)
        # against the string the LM reads: the tokenizer's normaliser turns clause marks into breaks
        refs = [normalize_phonemes(u.phonemes) for u in utts]
        cer = float(
            np.mean([edit_distance(ch, ref) / len(ref) for ref, (ch, _, _) in zip(refs, parsed)])
        )
        n = min(n_audio.get(lang, 0), len(utts))
        spoken = _spoken_of(cfg, utts)
        asr = None
        if lang == "en":
            arpa = cfg.cache / f"eval_{name}.arpa"
            write_arpa(list(spoken.values()), arpa)
            asr = Recognizer(arpa)
        systems: dict[str, list[dict]] = {}
        if with_teacher:
            codes = split_codes(cfg, name)
            systems.update(
                teacher_rows(
                    cfg,
                    lang,
                    name,
                    utts[:n],
                    codes,
                    tools["decoder"],
                    tools["backend"],
                    tools["mel"],
                    asr,
                    spoken,
                )
            )
        voice = []
        for k, u in enumerate(utts[:n]):
            gen_codes = parsed[k][1] if len(parsed[k][1]) >= 2 else [0, 0]
            _, audio = vocode(gen_codes, tools["decoder"], tools["backend"])
            voice.append(score(audio, u, lang, tools["mel"], asr, spoken))
        systems["voice"] = voice
        hyps[f"{name}/{decoding.name}"] = [{"text": u.text, **r} for u, r in zip(utts, voice)]
        for system, rs in systems.items():
            entry = {
                "set": name,
                "lang": lang,
                "system": system if system != "voice" else decoding.name,
                "n": len(rs),
                "dnsmos": float(np.mean([r["dnsmos"] for r in rs])) if rs else float("nan"),
            }
            if system != "teacher audio" and rs:
                entry["mcd_db"] = float(np.mean([r["mcd"] for r in rs]))
            if lang == "en" and rs:
                entry["wer"] = sum(r["errors"] for r in rs) / max(
                    1, sum(r["ref_words"] for r in rs)
                )
            if system == "voice":
                entry.update(
                    n_generated=len(utts),
                    duration_ratio=float(np.median(ratios)),
                    below_half=int((ratios < 0.5).sum()),
                    above_2x=int((ratios > 2).sum()),
                    runaway=runaway,
                    phoneme_copy_cer=cer,
                    generation_s=gen_s,
                )
            rows.append(entry)
            print(json.dumps(entry), flush=True)
    return rows, hyps


def _tools(cfg: RecipeConfig) -> dict:
    from vocoder_service.backends import TorchBackend
    from vocoder_service.mel import MelSpectrogram

    backend = TorchBackend()
    predictor = cfg.cache / "durations" / "duration_predictor.safetensors"
    return {
        "decoder": load_decoder(cfg),
        "backend": backend,
        "mel": MelSpectrogram(backend.config),
        "predictor": predictor if predictor.exists() else None,
    }


def choose_decoding(cfg: RecipeConfig, lm_dir: Path | None = None, n_en: int = 40) -> Decoding:
    """Score every candidate decoding on the natural validation slice; keep the best deployable one
    (lowest English WER with no sentence below half or above twice the teacher's length)."""
    torch.set_num_threads(cfg.threads)
    lm_dir = lm_dir or cfg.cache / "lm" / "best"
    val = splits_for_validation(cfg)
    tools = _tools(cfg)
    rows = []
    for cand in CANDIDATES:
        if not cand.sync:
            continue  # the free copy is scored on the held-out set, beside the chosen decoding
        cached = cfg.cache / "choice" / f"{cand.name}.json"
        if cached.exists():
            rows += json.loads(cached.read_text())
            continue
        got, _ = score_decoding(cfg, lm_dir, cand, val, tools, {"en": n_en}, with_teacher=False)
        cached.parent.mkdir(exist_ok=True)
        cached.write_text(json.dumps(got))
        rows += got
    deployable = [
        r
        for r in rows
        if r["lang"] == "en" and r["system"] not in {c.name for c in CANDIDATES if c.oracle}
    ]
    fits = [
        r
        for r in deployable
        if all(
            x["below_half"] == 0 and x["above_2x"] == 0 for x in rows if x["system"] == r["system"]
        )
    ] or deployable
    best = min(fits, key=lambda r: r["wer"])["system"]
    chosen = next(c for c in CANDIDATES if c.name == best)
    report = {"lm_dir": str(lm_dir), "rows": rows, "chosen": chosen.name}
    (cfg.cache / "decoding.json").write_text(json.dumps(report, indent=1))
    print(table(report), f"chosen: {chosen.name}", flush=True)
    return chosen


def chosen_decoding(cfg: RecipeConfig) -> Decoding:
    """The decoding choose_decoding picked (run it first)."""
    path = cfg.cache / "decoding.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: run the eval step (it chooses the decoding first)"
        )
    name = json.loads(path.read_text())["chosen"]
    return next(c for c in CANDIDATES if c.name == name)


def splits_for_validation(cfg: RecipeConfig) -> list[tuple[str, str, list]]:
    """The natural validation slice the LM's checkpoint was chosen on (tails of the training splits)."""
    return [
        ("en", "en_train", load_split(cfg, "en_train")[-100:]),
        ("zh", "zh_train", load_split(cfg, "zh_train")[-40:]),
    ]


HELD_OUT = (
    ("en", "en_natural", 200),
    ("zh", "zh_natural", 40),
    ("en", "en_eval", 100),
    ("zh", "zh_eval", 20),
)


def teacher_scores(cfg: RecipeConfig) -> None:
    """Score the teachers on every held-out set (cached; independent of the LM, so it can run
    while the LM trains)."""
    torch.set_num_threads(cfg.threads)
    tools = _tools(cfg)
    for lang, name, n in HELD_OUT:
        utts = load_split(cfg, name)[:n]
        spoken = _spoken_of(cfg, load_split(cfg, name))
        asr = None
        if lang == "en":
            arpa = cfg.cache / f"eval_{name}.arpa"
            write_arpa(list(spoken.values()), arpa)
            asr = Recognizer(arpa)
        teacher_rows(
            cfg,
            lang,
            name,
            utts,
            split_codes(cfg, name),
            tools["decoder"],
            tools["backend"],
            tools["mel"],
            asr,
            spoken,
        )
        print(f"teacher scores of {name}: done", flush=True)


def evaluate(cfg: RecipeConfig, lm_dir: Path | None = None, tag: str = "") -> dict:
    """Choose the decoding on validation, then score the held-out sets and write `eval/`.

    Duration and copy figures cover every sentence of each set; audio scores (WER, DNSMOS, MCD)
    the first 200 / 40 natural and 100 / 20 template sentences (English / Mandarin)."""
    torch.set_num_threads(cfg.threads)
    lm_dir = lm_dir or cfg.cache / "lm" / "best"
    decoding = (
        chosen_decoding(cfg)
        if (cfg.cache / "decoding.json").exists()
        else choose_decoding(cfg, lm_dir)
    )
    out_dir = cfg.cache / f"eval{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    tools = _tools(cfg)
    rows, hyps = [], {}
    for lang, name, n in HELD_OUT:
        got, h = score_decoding(
            cfg, lm_dir, decoding, [(lang, name, load_split(cfg, name))], tools, {lang: n}
        )
        rows += got
        hyps.update(h)
    free = next(c for c in CANDIDATES if not c.sync)  # the old bundles' decoding, for comparison
    free_rows, _ = score_decoding(
        cfg,
        lm_dir,
        free,
        [("en", "en_natural", load_split(cfg, "en_natural"))],
        tools,
        {"en": 100},
        with_teacher=False,
    )
    report = {"lm_dir": str(lm_dir), "decoding": decoding.name, "rows": rows + free_rows}
    (out_dir / "hyps.json").write_text(json.dumps(hyps, indent=1, ensure_ascii=False))
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "table.md").write_text(table(report))
    print(table(report))
    return report


def table(report: dict) -> str:
    """The evaluation as a Markdown table."""
    lines = [
        "| set | system | n | WER | DNSMOS | MCD (dB) | duration ratio (median) | < 0.5x / > 2x | "
        "phoneme-copy error | runaway |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:

        def f(key: str, fmt: str) -> str:
            return format(r[key], fmt) if key in r else "-"  # noqa: B023 - this row only

        out_of_range = (
            f"{r['below_half']} / {r['above_2x']} of {r['n_generated']}"
            if "below_half" in r
            else "-"
        )
        runaway = f"{r['runaway']}/{r['n_generated']}" if "runaway" in r else "-"
        lines.append(
            f"| {r['set']} | {r['system']} | {r['n']} | {f('wer', '.1%')} | {f('dnsmos', '.2f')} | "
            f"{f('mcd_db', '.2f')} | {f('duration_ratio', '.2f')} | {out_of_range} | "
            f"{f('phoneme_copy_cer', '.1%')} | {runaway} |"
        )
    return "\n".join(lines) + "\n"
