"""Step `durations`: a convolutional duration predictor, speech tokens per phoneme character.

Trained on the teachers' phone timings as the data step aligned them; it runs on the
orchestrator through `orchestrator.durations.DurationPredictor` (numpy), which this module's
network mirrors weight for weight.
"""

from __future__ import annotations

import json
import random
import time

import numpy as np
import torch
from torch import nn

from recipes.default_voice.config import RecipeConfig
from recipes.default_voice.data import load_split
from recipes.default_voice.lm import SPEECH_START, char_id, normalize_phonemes

CHANNELS, KERNEL, LAYERS = 128, 5, 3


class DurationNet(nn.Module):
    """Embedding, three same-padded conv layers with ReLU, a linear head: log(1 + tokens)."""

    def __init__(
        self,
        vocab: int = SPEECH_START,
        channels: int = CHANNELS,
        kernel: int = KERNEL,
        layers: int = LAYERS,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(vocab, channels) * 0.3)
        self.convs = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, padding=kernel // 2) for _ in range(layers)
        )
        self.proj = nn.Linear(channels, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding[ids].transpose(1, 2)  # [B, C, T]
        for conv in self.convs:
            x = self.dropout(torch.relu(conv(x)))
        return self.proj(x.transpose(1, 2)).squeeze(-1)


def _pairs(cfg: RecipeConfig, split: str) -> list[tuple[list[int], np.ndarray]]:
    out = []
    for u in load_split(cfg, split):
        if normalize_phonemes(u.phonemes) == u.phonemes:
            out.append(([char_id(c) for c in u.phonemes], u.durations.astype(np.float32)))
    return out


def _batch(pairs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = max(len(ids) for ids, _ in pairs)
    ids = torch.zeros(len(pairs), t, dtype=torch.long)
    target = torch.zeros(len(pairs), t)
    mask = torch.zeros(len(pairs), t)
    for r, (i, d) in enumerate(pairs):
        ids[r, : len(i)] = torch.tensor(i)
        target[r, : len(i)] = torch.from_numpy(np.log1p(d))
        mask[r, : len(i)] = 1
    return ids, target, mask


def evaluate_durations(net: DurationNet, pairs) -> dict[str, float]:
    """Mean absolute error in tokens per character and the sentence-total ratio's spread."""
    net.eval()
    errs, ratios = [], []
    with torch.no_grad():
        for k in range(0, len(pairs), 64):
            chunk = pairs[k : k + 64]
            ids, _, mask = _batch(chunk)
            pred = torch.expm1(net(ids)).clamp(min=0) * mask
            for r, (_, d) in enumerate(chunk):
                p = pred[r, : len(d)].numpy()
                errs.append(np.abs(p - d).mean())
                ratios.append(p.sum() / max(1.0, d.sum()))
    net.train()
    return {
        "mae_tokens": float(np.mean(errs)),
        "total_ratio_median": float(np.median(ratios)),
        "total_ratio_p5": float(np.percentile(ratios, 5)),
        "total_ratio_p95": float(np.percentile(ratios, 95)),
    }


def train_durations(cfg: RecipeConfig, steps: int = 1000) -> None:
    """Train on both languages' training splits; keep the best on the natural held-out sets."""
    from safetensors.torch import save_file

    out = cfg.cache / "durations"
    if (out / "done").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    train = _pairs(cfg, "en_train") + _pairs(cfg, "zh_train")
    held = _pairs(cfg, "en_natural") + _pairs(cfg, "zh_natural")
    net = DurationNet()
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    rng = random.Random(cfg.seed)
    best, t0, report = float("inf"), time.time(), {}
    for step in range(1, steps + 1):
        ids, target, mask = _batch(rng.sample(train, 32))
        loss = (((net(ids) - target) ** 2) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == steps:
            score = evaluate_durations(net, held)
            print(
                f"durations step {step}: train {loss.item():.4f} held-out {json.dumps(score)} "
                f"({time.time() - t0:.0f} s)",
                flush=True,
            )
            if score["mae_tokens"] < best:
                best, report = score["mae_tokens"], {"step": step, **score}
                state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
                save_file(state, str(out / "duration_predictor.safetensors"))
    # log-domain regression under-predicts totals: one scale, fit on training sentences, fixes it
    from safetensors.torch import load_file

    net.load_state_dict(load_file(str(out / "duration_predictor.safetensors")))
    fit = evaluate_durations(net, rng.sample(train, 500))
    scale = 1.0 / fit["total_ratio_median"]
    (out / "duration_predictor.json").write_text(json.dumps({"scale": scale}, indent=1) + "\n")
    report["scale"] = scale
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "done").write_text("ok")
