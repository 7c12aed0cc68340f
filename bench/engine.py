"""Our LLMEngine against HF `generate` on random ~150M Qwen3.5 and Qwen3 models, 2 CPU threads.

Figures per model: output tokens/s of the engine (all requests at once) vs HF one request at a
time and in padded static batches of 16; KV bytes per token vs the theoretical minimum (plus
linear-attention state per sequence); TTFT p50/p99 under Poisson arrivals at 70% of the
engine's measured capacity vs the same requests' TTFT when each runs alone.

    python -m bench.engine [--quick] [--json] [--model qwen3_5|qwen3|both] [--dtype float32]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings

import torch

from bench.workload import (
    FULL,
    MODEL_KINDS,
    QUICK,
    Request,
    WorkloadSpec,
    machine_load,
    make_workload,
    model_dir,
    output_tokens,
    percentile,
    poisson_arrivals,
    spread_subset,
)

THREADS = 2  # torch threads for both sides
STATIC_BATCH = 16
LOAD_FACTOR = 0.7
MAX_MODEL_LEN = 512
GOALS = {
    "speedup_vs_hf_sequential": (">=", 5.0),
    "speedup_vs_hf_static": (">=", 1.5),
    "ttft_p99_vs_solo": ("<=", 3.0),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- HF baselines -------------------------------------------------------------------------------
def load_hf(path, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def _gen_config(n: int):
    from transformers import GenerationConfig

    # eos None: generate exactly n tokens, as the engine does with ignore_eos.
    return GenerationConfig(
        max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0
    )


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy, left-padded batch generate of exactly `n` tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(ids, attention_mask=mask, generation_config=_gen_config(n))
    if out.shape[1] != width + n:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {n}")
    return out[:, width:].tolist()


def time_hf_sequential(model, requests: list[Request]) -> float:
    """Output tokens/s of HF generating one request at a time."""
    start = time.perf_counter()
    for r in requests:
        hf_generate(model, [r.prompt_token_ids], r.max_tokens)
    return output_tokens(requests) / (time.perf_counter() - start)


def time_hf_static(model, requests: list[Request]) -> float:
    """Useful output tokens/s of HF in padded batches of 16, each run to its longest request."""
    start = time.perf_counter()
    for i in range(0, len(requests), STATIC_BATCH):
        batch = requests[i : i + STATIC_BATCH]
        hf_generate(model, [r.prompt_token_ids for r in batch], max(r.max_tokens for r in batch))
    return output_tokens(requests) / (time.perf_counter() - start)


# -- our engine ---------------------------------------------------------------------------------
def build_engine(path, dtype: str, kv_gib: float):
    from text_service.engine import EngineArgs, LLMEngine

    # Prefix caching off: phases replay the same prompts, and HF caches nothing either.
    return LLMEngine(
        EngineArgs(
            model=str(path),
            device="cpu",
            dtype=dtype,
            kv_cache_memory_bytes=int(kv_gib * 2**30),
            max_num_seqs=64,
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=False,
        )
    )


def _params(n: int):
    from text_service.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_offline(engine, requests: list[Request], tag: str) -> dict:
    """All requests at once; output tokens/s and KV bytes per cached token at the peak."""
    block_bytes = engine.runner.kv_bytes_per_block(engine.config.block_size)
    start = time.perf_counter()
    seqs = [
        engine.add_request(f"{tag}{i}", r.prompt_token_ids, _params(r.max_tokens))
        for i, r in enumerate(requests)
    ]
    peak_blocks, peak_tokens = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        used = engine.stats()["num_used_blocks"]
        if used > peak_blocks:
            peak_blocks = used
            peak_tokens = sum(s.num_computed_tokens for s in seqs if not s.is_finished)
    elapsed = time.perf_counter() - start
    produced = sum(s.num_output_tokens for s in seqs)
    if produced != output_tokens(requests):
        raise RuntimeError(f"engine produced {produced} tokens, expected {output_tokens(requests)}")
    return {
        "tokens_per_s": produced / elapsed,
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "kv_bytes_per_token_in_use": peak_blocks * block_bytes / max(peak_tokens, 1),
        "num_preemptions": engine.stats()["num_preemptions"],
    }


def solo_ttfts(engine, requests: list[Request]) -> list[float]:
    """TTFT of each request run alone on an idle engine (prefill + first sample)."""
    out = []
    for i, r in enumerate(requests):
        start = time.perf_counter()
        engine.add_request(f"solo{i}", r.prompt_token_ids, _params(1))
        first = None
        while engine.has_unfinished_requests():
            if any(o.new_token_ids for o in engine.step()) and first is None:
                first = time.perf_counter()
        out.append(first - start)
    return out


def poisson_ttfts(engine, requests: list[Request], rate: float, seed: int) -> dict:
    """Drive step() in a loop, adding each request once its Poisson arrival time has passed."""
    offsets = poisson_arrivals(len(requests), rate, seed)
    t0 = time.perf_counter() + 0.01
    arrival, first = {}, {}
    nxt, max_running = 0, 0
    while nxt < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(requests) and t0 + offsets[nxt] <= now:
            arrival[nxt] = t0 + offsets[nxt]
            engine.add_request(
                nxt,
                requests[nxt].prompt_token_ids,
                _params(requests[nxt].max_tokens),
                arrival_time=arrival[nxt],
            )
            nxt += 1
        if engine.has_unfinished_requests():
            outputs = engine.step()
            done = time.perf_counter()
            for o in outputs:
                if o.new_token_ids and o.seq.seq_id not in first:
                    first[o.seq.seq_id] = done
            max_running = max(max_running, engine.stats()["num_running"])
        else:
            time.sleep(max(0.0, t0 + offsets[nxt] - now))
    ttft = [first[i] - arrival[i] for i in range(len(requests))]
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "max_running": max_running,
        "duration_s": time.perf_counter() - t0,
    }


def kv_figures(engine, model_config) -> dict:
    """Allocated KV bytes per token slot vs the minimum, and linear-attention state per sequence."""
    model = engine.runner.model
    attn = list(model.attention_layers().values())
    slots = engine.config.num_kv_blocks * engine.config.block_size
    allocated = sum(a.k_cache.nbytes + a.v_cache.nbytes for a in attn) / slots if attn else 0.0
    itemsize = engine.dtype.itemsize
    layer_types = (
        getattr(model_config, "layer_types", None)
        or ["full_attention"] * model_config.num_hidden_layers
    )
    head_dim = (
        getattr(model_config, "head_dim", None)
        or model_config.hidden_size // model_config.num_attention_heads
    )
    n_full = sum(t == "full_attention" for t in layer_types)
    minimum = n_full * 2 * model_config.num_key_value_heads * head_dim * itemsize
    out = {
        "kv_bytes_per_token": allocated,
        "kv_bytes_per_token_min": minimum,
        "kv_vs_min": allocated / minimum if minimum else None,
    }
    mixers = list(model.linear_attention_layers().values())
    if mixers:
        pool = engine.config.state_pool_size
        c = model_config
        conv_dim = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        )
        state_min = len(mixers) * (
            conv_dim * (c.linear_conv_kernel_dim - 1) * itemsize
            + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        )
        out.update(
            state_bytes_per_seq=sum(m.conv_state.nbytes + m.ssm_state.nbytes for m in mixers)
            / pool,
            state_bytes_per_seq_min=state_min,
            state_slots=pool,
        )
    return out


# -- one model ----------------------------------------------------------------------------------
def greedy_check(engine, hf, vocab: int, n: int) -> dict:
    """Our greedy tokens vs HF's on two fresh prompts (not in the workload)."""
    import random

    rng = random.Random(1234)
    prompts = [[rng.randrange(3, vocab) for _ in range(k)] for k in (37, 90)]
    ours = engine.generate(prompts, _params(n))
    theirs = [hf_generate(hf, [p], n)[0] for p in prompts]
    agree = [
        next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in zip(ours, theirs)
    ]
    return {
        "greedy_match": all(a == n for a in agree),
        "greedy_tokens_agreeing": agree,
        "greedy_tokens": n,
    }


def bench_model(kind: str, args, spec: WorkloadSpec) -> dict:
    path = model_dir(kind, args.dtype)
    requests = make_workload(spec, seed=args.seed)
    hf = load_hf(path, args.dtype)
    engine = build_engine(path, args.dtype, args.kv_cache_gib)
    res = {
        "model_dir": str(path),
        "parameters_m": round(sum(p.numel() for p in hf.parameters()) / 1e6, 1),
    }
    res.update(greedy_check(engine, hf, hf.config.vocab_size, 8 if args.quick else 24))
    log(
        f"[{kind}] greedy tokens vs HF: {'✓' if res['greedy_match'] else '✗'} "
        f"({res['greedy_tokens_agreeing']} of {res['greedy_tokens']} agree)"
    )
    run_offline(engine, make_workload(WorkloadSpec(4, (16, 32), (4, 8)), seed=99), "warm")

    offline = run_offline(engine, requests, "r")
    log(f"[{kind}] engine: {offline['tokens_per_s']:.1f} tok/s ({offline['elapsed_s']:.1f} s)")
    res.update({"engine_" + k: v for k, v in offline.items() if not k.startswith("kv")})
    res.update(
        kv_figures(engine, hf.config),
        kv_bytes_per_token_in_use=offline["kv_bytes_per_token_in_use"],
    )

    solo = solo_ttfts(engine, requests)
    rate = LOAD_FACTOR * offline["requests_per_s"]
    loaded = poisson_ttfts(engine, requests, rate, args.seed)
    res.update(
        solo_ttft_p50_s=percentile(solo, 50),
        solo_ttft_p99_s=percentile(solo, 99),
        poisson_rate_per_s=rate,
        poisson_max_running=loaded["max_running"],
        ttft_p50_s=loaded["ttft_p50_s"],
        ttft_p99_s=loaded["ttft_p99_s"],
        ttft_p99_vs_solo=loaded["ttft_p99_s"] / percentile(solo, 99),
    )
    log(
        f"[{kind}] TTFT p99 {loaded['ttft_p99_s'] * 1e3:.0f} ms under load vs "
        f"{res['solo_ttft_p99_s'] * 1e3:.0f} ms solo"
    )

    seq_requests = spread_subset(requests, args.hf_sequential_requests or len(requests))
    res["hf_sequential_tokens_per_s"] = time_hf_sequential(hf, seq_requests)
    res["hf_sequential_requests_timed"] = len(seq_requests)
    log(
        f"[{kind}] HF sequential: {res['hf_sequential_tokens_per_s']:.1f} tok/s on {len(seq_requests)} requests"
    )
    res["hf_static_tokens_per_s"] = time_hf_static(hf, requests)
    log(f"[{kind}] HF static x{STATIC_BATCH}: {res['hf_static_tokens_per_s']:.1f} tok/s")
    res["speedup_vs_hf_sequential"] = offline["tokens_per_s"] / res["hf_sequential_tokens_per_s"]
    res["speedup_vs_hf_static"] = offline["tokens_per_s"] / res["hf_static_tokens_per_s"]
    res["goals_met"] = {
        k: (res[k] >= v if op == ">=" else res[k] <= v) for k, (op, v) in GOALS.items()
    }
    del engine, hf
    gc.collect()
    return res


def print_table(report: dict) -> None:
    kinds = list(report["models"])
    rows = [
        ("parameters (M)", "parameters_m", "{:.1f}"),
        ("greedy tokens equal HF", "greedy_match", "{}"),
        ("engine output tok/s", "engine_tokens_per_s", "{:.1f}"),
        ("HF sequential tok/s", "hf_sequential_tokens_per_s", "{:.1f}"),
        ("  (requests timed)", "hf_sequential_requests_timed", "{}"),
        ("HF static x16 tok/s", "hf_static_tokens_per_s", "{:.1f}"),
        ("speedup_vs_hf_sequential (>=5)", "speedup_vs_hf_sequential", "{:.2f}"),
        ("speedup_vs_hf_static (>=1.5)", "speedup_vs_hf_static", "{:.2f}"),
        ("KV bytes/token (allocated)", "kv_bytes_per_token", "{:.0f}"),
        ("KV bytes/token (minimum)", "kv_bytes_per_token_min", "{:.0f}"),
        ("KV bytes/token in use at peak", "kv_bytes_per_token_in_use", "{:.0f}"),
        ("linear state bytes/seq", "state_bytes_per_seq", "{:.0f}"),
        ("linear state bytes/seq (min)", "state_bytes_per_seq_min", "{:.0f}"),
        ("solo TTFT p50 / p99 (ms)", ("solo_ttft_p50_s", "solo_ttft_p99_s"), "{:.0f} / {:.0f}"),
        ("Poisson rate (req/s)", "poisson_rate_per_s", "{:.2f}"),
        ("loaded TTFT p50 / p99 (ms)", ("ttft_p50_s", "ttft_p99_s"), "{:.0f} / {:.0f}"),
        ("ttft_p99_vs_solo (<=3)", "ttft_p99_vs_solo", "{:.2f}"),
        ("preemptions", "engine_num_preemptions", "{}"),
    ]
    print(f"{report['workload']}; dtype {report['dtype']}; {report['threads']} threads")
    print(
        f"machine load at start {report['machine_load_start']}, at end {report['machine_load_end']}; "
        f"wall {report['wall_s']:.0f} s"
    )
    print(f"{'':34}" + "".join(f"{k:>16}" for k in kinds))
    for label, key, fmt in rows:
        cells = []
        for k in kinds:
            m = report["models"][k]
            if isinstance(key, tuple):
                cells.append(fmt.format(*(m[x] * 1e3 for x in key)) if key[0] in m else "-")
            else:
                cells.append(fmt.format(m[key]) if key in m else "-")
        print(f"{label:34}" + "".join(f"{c:>16}" for c in cells))
    for note in report["notes"]:
        print("note:", note)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="smaller workload, HF sequential on 3 requests"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--model", choices=[*MODEL_KINDS, "both"], default="both")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--hf-sequential-requests",
        type=int,
        default=None,
        help="time HF sequential on this many requests and extrapolate its rate (default: all; 3 with --quick)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=THREADS, help="torch threads for both sides")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick and args.hf_sequential_requests is None:
        args.hf_sequential_requests = 3
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    spec = QUICK if args.quick else FULL
    kinds = list(MODEL_KINDS) if args.model == "both" else [args.model]
    start = time.perf_counter()
    report = {
        "quick": args.quick,
        "dtype": args.dtype,
        "threads": args.threads,
        "workload": spec.describe(),
        "load_factor": LOAD_FACTOR,
        "machine_load_start": machine_load(),
        "models": {},
    }
    for kind in kinds:
        report["models"][kind] = bench_model(kind, args, spec)
    n_seq = {m["hf_sequential_requests_timed"] for m in report["models"].values()}
    report["notes"] = [
        "tokens/s count only requested output tokens; HF static batches pay for padding and idle rows",
        "TTFT is measured from the scheduled arrival to the step that returns the first token; "
        "ttft_p99_vs_solo = loaded p99 / p99 of the same requests each run alone",
        "the machine is shared: expect noise of 10% or more between runs, far more when another "
        "process holds a core (torch's 2 OpenMP threads then wait on each other; see bench/README.md)",
    ]
    if max(n_seq) < spec.num_requests:
        report["notes"].insert(
            0,
            f"HF sequential timed on {sorted(n_seq)} of {spec.num_requests} requests "
            "(spread through the workload); its tokens/s is extrapolated to all",
        )
    if args.quick:
        report["notes"].insert(
            0, f"--quick: workload scaled down to {spec.describe()} (full: {FULL.describe()})"
        )
    report["wall_s"] = time.perf_counter() - start
    report["machine_load_end"] = machine_load()
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return report


if __name__ == "__main__":
    main()
