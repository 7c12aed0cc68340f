"""What the engine benchmarks share: random ~150M models, the request mix, arrivals, percentiles.

Importable without torch (the vLLM worker reads workloads as JSON); model building imports
torch and transformers lazily.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MODEL_CACHE = Path(
    os.environ.get("SPLIT_TTS_BENCH_MODELS", "~/.cache/split-tts/bench-models")
).expanduser()
VOCAB_SIZE = 32000
EOS_TOKEN_ID = 2  # present in the config so that ignore_eos means something

# ~150M parameters each, tied embeddings, vocabulary 32k.
MODEL_KINDS: dict[str, dict] = {
    "qwen3_5": dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=1024,
        intermediate_size=1792,
        num_hidden_layers=12,  # default layer_types: three Gated DeltaNet layers, then one full attention
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=1024,
        intermediate_size=2304,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
    ),
}


@dataclass(frozen=True)
class Request:
    """One benchmark request: prompt ids and exactly how many tokens to generate (EOS ignored)."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    """Request count and inclusive length ranges."""

    num_requests: int = 64
    prompt_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (128, 256)

    def describe(self) -> str:
        return (
            f"{self.num_requests} requests, prompts {self.prompt_len[0]}-{self.prompt_len[1]} tokens, "
            f"{self.output_len[0]}-{self.output_len[1]} output tokens, EOS ignored"
        )


FULL = WorkloadSpec()
QUICK = WorkloadSpec(num_requests=16, prompt_len=(16, 64), output_len=(16, 32))


def make_workload(spec: WorkloadSpec, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> list[Request]:
    """Uniformly random lengths and token ids (no shared prefixes), reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(spec.num_requests):
        n_prompt = rng.randint(*spec.prompt_len)
        prompt = [rng.randrange(3, vocab_size) for _ in range(n_prompt)]
        out.append(Request(prompt, rng.randint(*spec.output_len)))
    return out


def save_workload(requests: list[Request], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in requests]))


def load_workload(path: str | Path) -> list[Request]:
    return [Request(**r) for r in json.loads(Path(path).read_text())]


def output_tokens(requests: list[Request]) -> int:
    return sum(r.max_tokens for r in requests)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds from 0) of `n` requests of a Poisson process of `rate` per second."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def memory_read_gbs(mib: int = 256, repeats: int = 5) -> dict:
    """GB/s at which torch sums `mib` MiB of fp32 (far more than any cache), best of `repeats`,
    with the run's torch threads. A shared VM's memory bandwidth drifts by 1.5x within an hour,
    and the decode attention and the speech LM's projections are bound by it."""
    import torch

    x = torch.ones(mib << 18)
    x.sum()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return {
        "memory_read_gbs": round(x.numel() * 4 / best / 1e9, 1),
        "threads": torch.get_num_threads(),
    }


def machine_load() -> dict:
    """1-minute load average, CPU pressure and memory bandwidth: how shared the machine was
    during a run."""
    out = {"loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    try:
        with open("/proc/pressure/cpu") as f:
            out["cpu_pressure_some_avg60"] = float(f.readline().split()[2].split("=")[1])
    except OSError:
        pass
    out.update(memory_read_gbs())
    return out


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty list")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread_subset(requests: list[Request], k: int) -> list[Request]:
    """`k` requests picked evenly through the list (the lengths are random, so this is a fair sample)."""
    if k >= len(requests):
        return list(requests)
    step = len(requests) / k
    return [requests[int(i * step)] for i in range(k)]


def model_dir(kind: str, dtype: str = "float32") -> Path:
    """Directory of the random `kind` model in `dtype`, built with transformers on first use."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}: expected one of {sorted(MODEL_KINDS)}")
    out = MODEL_CACHE / f"{kind}-150m-{dtype}-v1"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[kind]
    config = config_cls(
        **MODEL_KINDS[kind], eos_token_id=EOS_TOKEN_ID, bos_token_id=1, pad_token_id=0
    )
    torch.manual_seed(0)
    model = model_cls(config).to(getattr(torch, dtype)).eval()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _meta_model(kind: str):
    """`kind`'s HF model on the meta device: its shapes, no weights."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[kind]
    with torch.device("meta"):
        return model_cls(config_cls(**MODEL_KINDS[kind]))


def count_parameters(kind: str) -> int:
    """Parameter count of `kind` (tied embeddings counted once)."""
    return sum(p.numel() for p in _meta_model(kind).parameters())


def linear_parameters(kind: str) -> tuple[int, int]:
    """(decoder, head): the weights of `kind`'s decoder projections (every `nn.Linear` of its
    layers) and of its LM head."""
    from torch import nn

    model = _meta_model(kind)
    body = sum(m.weight.numel() for m in model.model.modules() if isinstance(m, nn.Linear))
    return body, model.lm_head.weight.numel()


def projection_flops(kind: str, requests: list[Request]) -> float:
    """FLOPs of the weight multiplies any engine must do for `requests` on `kind`: the decoder's
    projections on every prompt token and on every generated token but the last (the one never
    fed back), the LM head on one row per generated token (the prompt's last position, then each
    decode step). Attention, norms and the rest are not counted: a floor, not a model of a step."""
    body, head = linear_parameters(kind)
    rows = sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in requests)
    return 2.0 * (body * rows + head * output_tokens(requests))
