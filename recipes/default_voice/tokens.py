"""Steps 2-3: k-means codebook over stacked HiFi-GAN log-mel frames, then the token->mel decoder."""

from __future__ import annotations

import json
import pickle
import random
import time

import numpy as np
import torch
import torch.nn.functional as F

from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.data import load_split
from recipes.default_voice.teacher import Utterance
from vocoder_service.token_decoder import (
    ConvLayer,
    TokenDecoder,
    TokenDecoderConfig,
    load_token_decoder,
    save_token_decoder,
)

TRAIN_SPLITS = ("en_train", "zh_train")
EVAL_SPLITS = ("en_eval", "zh_eval")
NATURAL_SPLITS = ("en_natural", "zh_natural")


def stacked(mel: np.ndarray, frames_per_token: int) -> np.ndarray:
    """Log-mel `[80, T * fpt]` -> token vectors `[T, fpt * 80]`, frame-major like the codebook rows."""
    n, t = mel.shape
    t //= frames_per_token
    return (
        mel[:, : t * frames_per_token]
        .reshape(n, t, frames_per_token)
        .transpose(1, 2, 0)
        .reshape(t, -1)
    )


def assign(vectors: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid index per row (squared Euclidean)."""
    out = []
    c2 = (centroids * centroids).sum(1)
    for chunk in vectors.split(16384):
        out.append((c2[None] - 2 * chunk @ centroids.T).argmin(1))
    return torch.cat(out)


def kmeans(x: torch.Tensor, k: int, iters: int, seed: int) -> torch.Tensor:
    """Plain Lloyd k-means from random data points; empty clusters are re-seeded."""
    g = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(len(x), generator=g)[:k]].clone()
    for it in range(iters):
        idx = assign(x, centroids)
        sums = torch.zeros_like(centroids).index_add_(0, idx, x)
        counts = torch.bincount(idx, minlength=k).float()
        empty = counts == 0
        centroids = torch.where(empty[:, None], centroids, sums / counts.clamp(min=1)[:, None])
        if empty.any():
            centroids[empty] = x[torch.randint(len(x), (int(empty.sum()),), generator=g)]
        if it % 5 == 0 or it == iters - 1:
            err = (x - centroids[idx]).abs().mean().item()
            print(f"kmeans iter {it}: L1 {err:.4f}, empty {int(empty.sum())}", flush=True)
    return centroids


def encode(utts: list[Utterance], centroids: torch.Tensor, fpt: int) -> list[np.ndarray]:
    """Speech-token codes per utterance."""
    return [
        assign(torch.from_numpy(stacked(u.mel.astype(np.float32), fpt)), centroids)
        .numpy()
        .astype(np.int16)
        for u in utts
    ]


def build_codebook(cfg: RecipeConfig) -> None:
    """Fit the codebook, write `codebook.npy` and the codes of every split to `codes.pkl`."""
    path = cfg.cache / "codebook.npy"
    torch.set_num_threads(cfg.threads)
    fpt = cfg.frames_per_token
    if not path.exists() and cfg.init_from is not None:
        kept = load_token_decoder(cfg.init_from / "vocoder")
        if kept is None:
            raise FileNotFoundError(f"{cfg.init_from / 'vocoder'} holds no token decoder")
        np.save(path, kept.codebook.detach().numpy())
        save_token_decoder(kept, cfg.cache / "decoder")
        (cfg.cache / "decoder" / "report.json").write_text(
            json.dumps({"kept_from": str(cfg.init_from)})
        )
        (cfg.cache / "decoder" / "done").write_text("ok")
        print(f"codebook and token decoder kept from {cfg.init_from}", flush=True)
    if not path.exists():
        vecs = [
            stacked(u.mel.astype(np.float32), fpt) for s in TRAIN_SPLITS for u in load_split(cfg, s)
        ]
        x = torch.from_numpy(np.concatenate(vecs))
        rng = np.random.default_rng(cfg.seed)
        if len(x) > cfg.kmeans_frames:
            x = x[torch.from_numpy(rng.choice(len(x), cfg.kmeans_frames, replace=False))]
        print(f"kmeans over {len(x)} token vectors of {x.shape[1]} values", flush=True)
        np.save(path, kmeans(x, cfg.codebook_size, cfg.kmeans_iters, cfg.seed).numpy())
    centroids = torch.from_numpy(np.load(path))
    codes = {s: encode(load_split(cfg, s), centroids, fpt) for s in TRAIN_SPLITS + EVAL_SPLITS}
    (cfg.cache / "codes.pkl").write_bytes(pickle.dumps(codes))
    report = {}
    for s in EVAL_SPLITS:
        utts = load_split(cfg, s)
        err = [
            np.abs(
                stacked(u.mel.astype(np.float32), fpt) - centroids[c.astype(np.int64)].numpy()
            ).mean()
            for u, c in zip(utts, codes[s])
        ]
        report[s] = float(np.mean(err))
    print("codebook lookup mel L1 (held out):", report, flush=True)
    (cfg.cache / "codebook_report.json").write_text(json.dumps(report))


def load_codes(cfg: RecipeConfig) -> dict[str, list[np.ndarray]]:
    return pickle.loads((cfg.cache / "codes.pkl").read_bytes())


def split_codes(cfg: RecipeConfig, split: str) -> list[np.ndarray]:
    """Codes of one split: stored ones, else encoded now with the codebook (natural held-out sets)."""
    codes = load_codes(cfg)
    if split in codes:
        return codes[split]
    centroids = torch.from_numpy(np.load(cfg.cache / "codebook.npy"))
    return encode(load_split(cfg, split), centroids, cfg.frames_per_token)


def _crops(
    utts: list[Utterance],
    codes: list[np.ndarray],
    n: int,
    length: int,
    fpt: int,
    rng: random.Random,
) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for _ in range(n):
        i = rng.randrange(len(utts))
        c, mel = codes[i], utts[i].mel
        if len(c) < length:
            continue
        s = rng.randrange(len(c) - length + 1)
        xs.append(torch.from_numpy(c[s : s + length].astype(np.int64)))
        ys.append(torch.from_numpy(mel[:, s * fpt : (s + length) * fpt].astype(np.float32)))
    return torch.stack(xs), torch.stack(ys)


def decoder_l1(decoder: TokenDecoder, utts: list[Utterance], codes: list[np.ndarray]) -> float:
    """Mean held-out mel L1 of whole utterances."""
    errs = [
        np.abs(
            decoder.decode(c)
            - u.mel.astype(np.float32)[:, : len(c) * decoder.config.frames_per_token]
        ).mean()
        for u, c in zip(utts, codes)
    ]
    return float(np.mean(errs))


def train_decoder(cfg: RecipeConfig) -> None:
    """Train the residual conv decoder on codebook lookups; keep the best held-out checkpoint."""
    out = cfg.cache / "decoder"
    if (out / "done").exists():
        return
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    fpt = cfg.frames_per_token
    centroids = torch.from_numpy(np.load(cfg.cache / "codebook.npy"))
    layers = tuple(ConvLayer(k, r) for k, r in cfg.decoder_layers)
    dcfg = TokenDecoderConfig(
        codebook_size=cfg.codebook_size,
        num_mels=80,
        frames_per_token=fpt,
        channels=cfg.decoder_channels,
        layers=layers,
    )
    decoder = TokenDecoder(dcfg)
    with torch.no_grad():
        decoder.codebook.copy_(centroids)
        decoder.proj_out.weight.mul_(0.1)
    codes = load_codes(cfg)
    train = [(u, c) for s in TRAIN_SPLITS for u, c in zip(load_split(cfg, s), codes[s])]
    utts, tcodes = [u for u, _ in train], [c for _, c in train]
    held = [(u, c) for s in EVAL_SPLITS for u, c in list(zip(load_split(cfg, s), codes[s]))[:40]]
    hu, hc = [u for u, _ in held], [c for _, c in held]
    lookup = TokenDecoder(TokenDecoderConfig(codebook_size=cfg.codebook_size, frames_per_token=fpt))
    with torch.no_grad():
        lookup.codebook.copy_(centroids)
    best = decoder_l1(lookup, hu, hc)
    print(f"decoder: codebook-only held-out L1 {best:.4f}", flush=True)
    save_token_decoder(lookup, out)
    opt = torch.optim.AdamW(decoder.parameters(), lr=2e-3, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    t0 = time.time()
    for step in range(1, cfg.decoder_steps + 1):
        x, y = _crops(utts, tcodes, 24, 48, fpt, rng)
        loss = F.l1_loss(decoder(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == cfg.decoder_steps:
            decoder.eval()
            l1 = decoder_l1(decoder, hu, hc)
            decoder.train()
            print(
                f"decoder step {step}: train {loss.item():.4f} held-out {l1:.4f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
            if l1 < best:
                best = l1
                save_token_decoder(decoder, out)
    (out / "report.json").write_text(json.dumps({"held_out_l1": best, "steps": cfg.decoder_steps}))
    (out / "done").write_text("ok")


def load_decoder(cfg: RecipeConfig) -> TokenDecoder:
    decoder = load_token_decoder(cfg.cache / "decoder")
    if decoder is None:
        raise FileNotFoundError(
            f"no token decoder in {cfg.cache / 'decoder'}: run the decoder step"
        )
    return decoder
