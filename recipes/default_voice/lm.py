"""Step 4: the speech LM, a small `qwen3_5_text` over interleaved phoneme characters and speech tokens.

Sequence: `<|bos|> phonemes <|sep|> c1 s s s c2 c3 s s ... <|eos|>`: the phoneme string is
repeated after the separator with each character followed by the teacher's speech tokens for it,
so generation copies the next character when it decides the current sound is over.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.data import load_split
from recipes.default_voice.teacher import Utterance
from recipes.default_voice.tokens import load_codes

SPECIALS = ("<|pad|>", "<|bos|>", "<|sep|>", "<|eos|>", "<|unk|>")
PAD, BOS, SEP, EOS, UNK = range(5)
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
CHAR_BASE = len(SPECIALS)
SPEECH_START = 128
PROMPT_TEMPLATE = "<|bos|>{text}<|sep|>"
CLAUSE_PUNCT = r"[,;.!?]+(?:\s+|$)"


def char_id(ch: str) -> int:
    i = CHARS.find(ch)
    return CHAR_BASE + i if i >= 0 else UNK


def vocab_size(codebook_size: int) -> int:
    return SPEECH_START + codebook_size


def normalize_phonemes(text: str) -> str:
    """What the tokenizer's normalizer does: clause breaks to one newline, spaces collapsed, trimmed.

    A clause break is a newline (espeak-ng's own output) or sentence punctuation followed by a
    space or the end (the orchestrator's front end with `keep_punctuation`).
    """
    import re

    text = re.sub(CLAUSE_PUNCT, "\n", text.strip())
    text = re.sub(r"[ \t\r]*\n\s*", "\n", text)
    return re.sub(r"[ \t\r]+", " ", text).strip()


def build_tokenizer(codebook_size: int):
    """A character-level `tokenizers.Tokenizer`: specials, ASCII phoneme characters, speech tokens."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i, ch in enumerate(CHARS):
        vocab[ch] = CHAR_BASE + i
    for i in range(CHAR_BASE + len(CHARS), SPEECH_START):
        vocab[f"<|reserved_{i}|>"] = i
    for k in range(codebook_size):
        vocab[f"<|s_{k}|>"] = SPEECH_START + k
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.Strip(),
            normalizers.Replace(Regex(CLAUSE_PUNCT), "\n"),
            normalizers.Replace(Regex(r"[ \t\r]*\n\s*"), "\n"),
            normalizers.Replace(Regex(r"[ \t\r]+"), " "),
            normalizers.Strip(),
        ]
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIALS]
        + [AddedToken(f"<|s_{k}|>", special=True, normalized=False) for k in range(codebook_size)]
    )
    return tok


def prompt_ids(phonemes: str) -> list[int]:
    return [BOS] + [char_id(c) for c in normalize_phonemes(phonemes)] + [SEP]


def sequence(u: Utterance, codes: np.ndarray) -> tuple[list[int], int]:
    """Token ids of one training sequence and the length of its prompt."""
    units = normalize_phonemes(u.phonemes)
    if units != u.phonemes:
        raise ValueError("phoneme strings are stored normalised")
    prompt = prompt_ids(units)
    body, pos = [], 0
    for ch, d in zip(units, u.durations):
        body.append(char_id(ch))
        body.extend(SPEECH_START + int(c) for c in codes[pos : pos + int(d)])
        pos += int(d)
    return prompt + body + [EOS], len(prompt)


def build_model(cfg: RecipeConfig):
    """A fresh `Qwen3_5ForCausalLM` of the recipe's size."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    heads = cfg.hidden_size // 64
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size(cfg.codebook_size),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 3,
        num_hidden_layers=cfg.num_layers,
        layer_types=list(cfg.layer_types),
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        attention_dropout=cfg.dropout,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    return Qwen3_5ForCausalLM(config)


def _batches(seqs: list[tuple[list[int], int]], budget: int, rng: random.Random) -> list[list[int]]:
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + rng.random())
    batches, cur, longest = [], [], 0
    for i in order:
        n = len(seqs[i][0])
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(
    seqs: list[tuple[list[int], int]],
    idx: list[int],
    noise: float,
    codebook_size: int,
    rng: torch.Generator | None,
) -> dict[str, torch.Tensor]:
    """Right-padded inputs; labels only after the prompt; speech inputs randomly replaced by `noise`."""
    t = max(len(seqs[i][0]) for i in idx)
    ids = torch.full((len(idx), t), PAD, dtype=torch.long)
    labels = torch.full((len(idx), t), -100, dtype=torch.long)
    mask = torch.zeros((len(idx), t), dtype=torch.long)
    for row, i in enumerate(idx):
        s, p = seqs[i]
        ids[row, : len(s)] = torch.tensor(s)
        labels[row, p : len(s)] = ids[row, p : len(s)]
        mask[row, : len(s)] = 1
    inputs = ids.clone()
    if noise > 0:
        speech = inputs >= SPEECH_START
        flip = speech & (torch.rand(inputs.shape, generator=rng) < noise)
        inputs[flip] = SPEECH_START + torch.randint(
            codebook_size, (int(flip.sum()),), generator=rng
        )
    return {"input_ids": inputs, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def generate(
    model, phonemes: str, max_new: int, temperature: float = 0.0, top_k: int = 50, seed: int = 0
) -> list[int]:
    """Free-running continuation of one prompt, up to and without the end token."""
    ids = torch.tensor([prompt_ids(phonemes)])
    kwargs = {"do_sample": temperature > 0}
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs.update(temperature=temperature, top_k=top_k, top_p=1.0)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        eos_token_id=EOS,
        pad_token_id=PAD,
        **kwargs,
    )[0, ids.shape[1] :].tolist()
    return out


def split_stream(stream: list[int]) -> tuple[str, list[int], bool]:
    """Generated ids -> (phoneme characters, speech codes, stopped with the end token)."""
    stopped = EOS in stream
    if stopped:
        stream = stream[: stream.index(EOS)]
    chars = "".join(CHARS[i - CHAR_BASE] for i in stream if CHAR_BASE <= i < CHAR_BASE + len(CHARS))
    codes = [i - SPEECH_START for i in stream if i >= SPEECH_START]
    return chars, codes, stopped


def edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def max_new_tokens(phonemes: str, cfg: RecipeConfig) -> int:
    """Generation cap: generous per phoneme character, bounded by the manifest's max_tokens."""
    return min(cfg.max_tokens, 8 * len(phonemes) + 60)


def held_out_loss(
    model, seqs: list[tuple[list[int], int]], cfg: RecipeConfig
) -> tuple[float, float]:
    """Teacher-forced loss and speech-token accuracy."""
    model.eval()
    losses, correct, total = [], 0, 0
    with torch.no_grad():
        for idx in _batches(seqs, cfg.lm_batch_tokens, random.Random(0)):
            b = collate(seqs, idx, 0.0, cfg.codebook_size, None)
            out = model(**b)
            losses.append(out.loss.item())
            pred = out.logits[:, :-1].argmax(-1)
            tgt = b["labels"][:, 1:]
            sel = tgt >= SPEECH_START
            correct += int((pred[sel] == tgt[sel]).sum())
            total += int(sel.sum())
    model.train()
    return float(np.mean(losses)), correct / max(1, total)


def splits(cfg: RecipeConfig) -> dict[str, list[tuple[Utterance, np.ndarray]]]:
    """Training pairs and a validation slice cut from the end of the training splits."""
    codes = load_codes(cfg)
    out: dict[str, list] = {"train": [], "val_en": [], "val_zh": []}
    for split, n_val in (("en_train", 100), ("zh_train", 40)):
        pairs = [
            (u, c)
            for u, c in zip(load_split(cfg, split), codes[split])
            if normalize_phonemes(u.phonemes) == u.phonemes and len(c) == int(u.durations.sum())
        ]
        out["train"].extend(pairs[:-n_val])
        out["val_" + split[:2]].extend(pairs[-n_val:])
    return out


def train_lm(cfg: RecipeConfig) -> None:
    """Train for `lm_minutes` of wall time; keep the checkpoint with the best free-running score."""
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(cfg.threads)  # spinning OpenMP threads lose badly on a shared machine
    work = cfg.cache / "lm"
    work.mkdir(parents=True, exist_ok=True)
    data = splits(cfg)
    train = [sequence(u, c) for u, c in data["train"]]
    # the validation slice is natural text: decoding is held to the phonemes by the engine's
    # constraint, so what picks the checkpoint is how well it predicts the acoustic tokens there
    val = [sequence(u, c) for u, c in data["val_en"] + data["val_zh"]]
    print(
        f"lm: {len(train)} training sequences, {sum(len(s) for s, _ in train)} tokens; "
        f"mean length {np.mean([len(s) for s, _ in train]):.0f}",
        flush=True,
    )
    model = build_model(cfg)
    peak_lr = cfg.lm_lr
    if cfg.init_from is not None:
        from transformers import Qwen3_5ForCausalLM

        model = Qwen3_5ForCausalLM.from_pretrained(cfg.init_from / "lm", dtype=torch.float32)
        peak_lr = cfg.lm_finetune_lr
        print(f"lm: fine-tuning the LM of {cfg.init_from}", flush=True)
    print(f"lm: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.05, betas=(0.9, 0.98))
    state_path = work / "state.pt"
    step, elapsed, best, history = 0, 0.0, math.inf, []
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed, best, history = (
            state["step"],
            state["elapsed"],
            state["best"],
            state["history"],
        )
        print(f"lm: resumed at step {step}, {elapsed / 60:.1f} min", flush=True)
        if history and history[-1].get("val_n") != len(val):
            best = math.inf  # scores from another validation set do not compare
    budget = cfg.lm_minutes * 60
    rng = random.Random(cfg.seed + step)
    gen = torch.Generator().manual_seed(cfg.seed + step)
    model.train()
    t_start = time.time()
    t_last, tokens, next_eval = time.time(), 0, elapsed + cfg.eval_minutes * 60
    if step == 0 and cfg.init_from is not None:
        vl, acc = held_out_loss(model, val, cfg)
        history.append(
            {"step": 0, "minutes": 0.0, "val_loss": vl, "val_acc": acc, "val_n": len(val)}
        )
        print("eval", json.dumps(history[-1]), flush=True)
    while elapsed < budget:
        for idx in _batches(train, cfg.lm_batch_tokens, rng):
            frac = elapsed / budget
            lr = (
                peak_lr
                * min(1.0, (step + 1) / 100)
                * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
            )
            for g in opt.param_groups:
                g["lr"] = lr
            b = collate(train, idx, 0.1, cfg.codebook_size, gen)
            loss = model(**b).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens += int(b["attention_mask"].sum())
            now = time.time()
            elapsed += now - t_last
            t_last = now
            if step % 25 == 0:
                print(
                    f"step {step} loss {loss.item():.3f} lr {lr:.2e} {elapsed / 60:.1f} min "
                    f"{tokens / max(1e-9, time.time() - t_start):.0f} tok/s",
                    flush=True,
                )
            if elapsed >= next_eval or elapsed >= budget:
                next_eval = elapsed + cfg.eval_minutes * 60
                vl, acc = held_out_loss(model, val, cfg)
                score = vl
                history.append(
                    {
                        "step": step,
                        "minutes": elapsed / 60,
                        "train_loss": loss.item(),
                        "val_loss": vl,
                        "val_acc": acc,
                        "val_n": len(val),
                    }
                )
                print("eval", json.dumps(history[-1]), flush=True)
                save_lm(model, work / f"step_{step}")
                if score < best:
                    best = score
                    save_lm(model, work / "best")
                    print(f"lm: new best at step {step}", flush=True)
                torch.save(
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "step": step,
                        "elapsed": elapsed,
                        "best": best,
                        "history": history,
                    },
                    state_path,
                )
                (work / "history.json").write_text(json.dumps(history, indent=1))
                t_last = time.time()
            if elapsed >= budget:
                break
    (work / "done").write_text("ok")


def save_lm(model, folder: Path) -> None:
    """Plain HF format plus the character tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    codebook_size = model.config.vocab_size - SPEECH_START
    build_tokenizer(codebook_size).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "unk_token": "<|unk|>",
                "model_max_length": 4096,
                "add_bos_token": False,
                "add_eos_token": False,
            },
            indent=1,
        )
        + "\n"
    )
