"""Batched next-token sampling: penalties, allowed ranges, temperature, top-k, top-p and seeds."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from text_service.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_MIN_TEMPERATURE = 1e-5  # below this a row is sampled greedily (dividing by it would overflow)


def apply_repetition_penalty(logits: Tensor, rows: Tensor, penalties: Tensor, token_ids: Tensor) -> None:
    """HF-style penalty in place: for ids in `token_ids[i]` (padded by repeats), positive logits
    of row `rows[i]` are divided by `penalties[i]`, negative ones multiplied."""
    sub = logits[rows]
    seen = sub.gather(1, token_ids)
    p = penalties[:, None]
    sub.scatter_(1, token_ids, torch.where(seen > 0, seen / p, seen * p))
    logits[rows] = sub


def apply_allowed_range(logits: Tensor, rows: Tensor, lo: Tensor, hi: Tensor,
                        exempt_rows: Tensor, exempt_ids: Tensor) -> None:
    """Set logits of row `rows[i]` outside [lo[i], hi[i]] to -inf in place, except the
    (`exempt_rows[j]` index into `rows`, `exempt_ids[j]`) pairs."""
    vocab = torch.arange(logits.shape[1], device=logits.device)
    outside = (vocab < lo[:, None]) | (vocab > hi[:, None])
    if exempt_ids.numel():
        outside[exempt_rows, exempt_ids] = False
    logits[rows] = logits[rows].masked_fill(outside, float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask all but each row's top_k logits (ties kept; k >= vocab is off) and the smallest set
    whose probability reaches top_p (p >= 1 is off); returns new logits."""
    neg_inf = float("-inf")
    if top_p is None:
        if top_k is None:
            return logits
        # topk of the largest k is cheaper than a full sort
        k = top_k.clamp(max=logits.shape[1])
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, neg_inf)
    ordered, index = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = top_k.clamp(max=logits.shape[1])
        ordered = ordered.masked_fill(ordered < ordered.gather(1, (k - 1)[:, None]), neg_inf)
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # 0 for the top token: it always survives
    threshold = torch.where(top_p >= 1, torch.full_like(top_p, 2.0), top_p)
    ordered = ordered.masked_fill(mass_before >= threshold[:, None], neg_inf)
    return torch.full_like(logits, neg_inf).scatter_(1, index, ordered)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request's `step`-th sample (the same in any batch)."""
    return _splitmix64((_splitmix64(seed) + step) & _MASK64)


class Sampler:
    """Picks one token per row of fp32 logits according to each row's SamplingParams.

    Greedy rows (temperature 0, or below 1e-5) take the argmax after penalties and range masks, so plain greedy
    equals HF greedy. Random rows draw Gumbel-style with exponential noise: unseeded rows from
    the sampler's generator, a seeded row from a generator seeded by (seed, output position),
    so its tokens do not depend on what else is in the batch.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._row_generator = torch.Generator(device=self.device)

    @torch.inference_mode()
    def __call__(self, logits: Tensor, params: list[SamplingParams],
                 histories: list[np.ndarray | None], steps: list[int]) -> list[int]:
        """Sample a token per row (penalties and masks edit `logits` in place). `histories[i]`: prompt + output ids so far (only read when a
        repetition penalty is set); `steps[i]`: output tokens so far (the seed stream offset)."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows but {len(params)} sampling params")
        if not params:
            return []
        self._penalize(logits, params, histories)
        self._mask_ranges(logits, params)
        random_rows = [i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE]
        if not random_rows:
            return logits.argmax(dim=-1).tolist()
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        if len(random_rows) < len(params):
            greedy = torch.tensor([i for i, p in enumerate(params) if p.temperature < _MIN_TEMPERATURE],
                                  device=logits.device)
            tokens[greedy] = logits[greedy].argmax(dim=-1)
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample([params[i] for i in random_rows], logits[rows],
                                        [steps[i] for i in random_rows])
        else:
            tokens = self._sample(params, logits, steps)
        return tokens.tolist()

    def _sample(self, params: list[SamplingParams], logits: Tensor, steps: list[int]) -> Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = logits / temps[:, None]
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params],
                                 device=device)
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
        probs = apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            noise.exponential_(generator=self.generator)
        for i in seeded:
            self._row_generator.manual_seed(step_seed(params[i].seed, steps[i]))
            noise[i].exponential_(generator=self._row_generator)
        # argmax(p / E) with E ~ Exp(1) draws from p; the floor keeps 0-probability ids unpicked
        return probs.div_(noise.clamp_min_(1e-20)).argmax(dim=-1)

    def _penalize(self, logits: Tensor, params: list[SamplingParams],
                  histories: list[np.ndarray | None]) -> None:
        rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
        if not rows:
            return
        windows = []
        for i in rows:
            history, window = histories[i], params[i].repetition_window
            if history is None or len(history) == 0:
                raise ValueError(f"row {i} has a repetition penalty but no token history")
            windows.append(history[-window:] if window else history)
        width = max(len(w) for w in windows)
        ids = np.empty((len(rows), width), dtype=np.int64)
        for r, w in enumerate(windows):
            ids[r, :len(w)] = w
            ids[r, len(w):] = w[-1]  # repeats leave the result unchanged
        device = logits.device
        penalties = torch.tensor([params[i].repetition_penalty for i in rows],
                                 dtype=logits.dtype, device=device)
        apply_repetition_penalty(logits, torch.tensor(rows, device=device), penalties,
                                 torch.from_numpy(ids).to(device))

    def _mask_ranges(self, logits: Tensor, params: list[SamplingParams]) -> None:
        rows = [i for i, p in enumerate(params) if p.allowed_token_range is not None]
        if not rows:
            return
        exempt_rows, exempt_ids = [], []
        for r, i in enumerate(rows):
            ids = params[i].exempt_token_ids(self.eos_token_ids)
            exempt_rows += [r] * len(ids)
            exempt_ids += ids
        device = logits.device
        lo = torch.tensor([params[i].allowed_token_range[0] for i in rows], device=device)
        hi = torch.tensor([params[i].allowed_token_range[1] for i in rows], device=device)
        apply_allowed_range(logits, torch.tensor(rows, device=device), lo, hi,
                            torch.tensor(exempt_rows, dtype=torch.long, device=device),
                            torch.tensor(exempt_ids, dtype=torch.long, device=device))
