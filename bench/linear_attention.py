"""The compiled CPU Gated DeltaNet kernels against the torch reference, side by side.

For each op (decode delta rule update, decode conv update, prefill delta rule, prefill conv) at
the benchmark model's sizes (8 value heads of 128 x 128, conv 3072 channels, kernel 4): both
implementations run alternately on the same inputs and state pool, several rounds; the figure
is reference time / compiled time (median over rounds). The pool holds the states of all nine
linear-attention layers, so that a decode step reads its states from memory as the engine does.

With `--engine`, the engine instead: three engines in one process, alternately on the same
workload (`bench.engine`'s quick one by default): Qwen3.5 with the reference linear-attention ops,
Qwen3.5 with the compiled ones, and Qwen3 (the same size, no linear attention).

    python -m bench.linear_attention [--threads 1] [--batch 16] [--prefill-tokens 2048] [--json]
    python -m bench.linear_attention --engine [--full] [--threads 1] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.workload import machine_load

HEADS, DK, DV, CONV_DIM, KERNEL, LAYERS = 8, 128, 128, 3072, 4, 9


def _time(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def side_by_side(name: str, reference, compiled, rounds: int, repeats: int) -> dict:
    reference(), compiled()  # warm-up
    ref_s, ours_s = [], []
    for _ in range(rounds):
        ref_s.append(_time(reference, repeats))
        ours_s.append(_time(compiled, repeats))
    ratios = [r / o for r, o in zip(ref_s, ours_s)]
    res = {
        "reference_ms": statistics.median(ref_s) * 1e3,
        "compiled_ms": statistics.median(ours_s) * 1e3,
        "speedup": statistics.median(ratios),
    }
    print(
        f"{name:28s} reference {res['reference_ms']:9.3f} ms  compiled {res['compiled_ms']:9.3f} ms  "
        f"x{res['speedup']:.2f}",
        file=sys.stderr,
        flush=True,
    )
    return res


def delta_inputs(tokens: int):
    q = F.normalize(torch.randn(tokens, HEADS, DK), dim=-1)
    k = F.normalize(torch.randn(tokens, HEADS, DK), dim=-1)
    v = torch.randn(tokens, HEADS, DV)
    g = -F.softplus(torch.randn(tokens, HEADS)) * 0.5
    beta = torch.rand(tokens, HEADS)
    return q, k, v, g, beta


LINEAR_ATTENTION_OPS = (
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
)


def engine_side_by_side(args) -> dict:
    """Output tokens/s of the three engines, round-robin, and the ratios of their medians."""
    import dataclasses

    from bench.engine import build_engine, run_offline
    from bench.workload import FULL, QUICK, make_workload, model_dir
    from kernels import ops as ops_table

    cpu = ops_table.get_ops("cpu")
    reference_linear = dataclasses.replace(
        cpu, **{name: getattr(ops_table.REFERENCE_OPS, name) for name in LINEAR_ATTENTION_OPS}
    )
    engines = {}
    try:  # the model takes its ops table once, when it is built
        ops_table._chosen["cpu"] = reference_linear
        engines["qwen3_5_reference"] = build_engine(model_dir("qwen3_5"), "float32", 1.0)
    finally:
        ops_table._chosen["cpu"] = cpu
    engines["qwen3_5_compiled"] = build_engine(model_dir("qwen3_5"), "float32", 1.0)
    engines["qwen3"] = build_engine(model_dir("qwen3"), "float32", 1.0)
    spec = FULL if args.full else QUICK
    requests = make_workload(spec, seed=0)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():  # warm-up
        run_offline(engine, requests[:4], "warm")
    for r in range(args.rounds):
        for name, engine in engines.items():
            rates[name].append(run_offline(engine, requests, f"r{r}")["tokens_per_s"])
            print(f"round {r} {name:18s} {rates[name][-1]:7.1f} tok/s", file=sys.stderr, flush=True)
    median = {name: statistics.median(v) for name, v in rates.items()}
    return {
        "workload": spec.describe(),
        "tokens_per_s": rates,
        "median_tokens_per_s": median,
        "compiled_vs_reference": median["qwen3_5_compiled"] / median["qwen3_5_reference"],
        "qwen3_5_vs_qwen3": median["qwen3_5_compiled"] / median["qwen3"],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=16, help="sequences in a decode step")
    p.add_argument(
        "--prefill-tokens", type=int, default=2048, help="tokens of a prefill step (4 sequences)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--engine", action="store_true", help="whole engines instead of the kernels")
    p.add_argument(
        "--full", action="store_true", help="with --engine: bench.engine's full workload"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.engine:
        report = {"threads": args.threads, **engine_side_by_side(args)}
        report["machine_load_end"] = machine_load()
        print(json.dumps(report) if args.json else report)
        return report
    from kernels import conv, cpu_ext, delta_rule

    if cpu_ext.build() is not None:
        raise SystemExit("the CPU kernels did not build")
    report = {"threads": args.threads, "batch": args.batch, "prefill_tokens": args.prefill_tokens}
    b = args.batch
    num_slots = LAYERS * b + 1
    pool = torch.randn(num_slots, HEADS, DK, DV) * 0.1
    layer_slots = [torch.randperm(num_slots)[:b] for _ in range(LAYERS)]
    q, k, v, g, beta = delta_inputs(b)

    def decode_step(fn):
        def run():
            for slots in layer_slots:  # one call per layer, each on its own states
                fn(q, k, v, g, beta, ssm_state=pool, state_indices=slots, scale=DK**-0.5)

        return run

    report["decode_delta_rule_9_layers"] = side_by_side(
        f"decode delta rule x{b} x9",
        decode_step(delta_rule.recurrent_gated_delta_rule),
        decode_step(cpu_ext.recurrent_gated_delta_rule),
        args.rounds,
        3,
    )

    conv_state = torch.randn(num_slots, CONV_DIM, KERNEL - 1)
    x = torch.randn(b, CONV_DIM + 1024 + 2 * HEADS)[:, :CONV_DIM]  # a slice of the fused projection
    weight = torch.randn(CONV_DIM, KERNEL)

    def conv_step(fn):
        def run():
            for slots in layer_slots:
                fn(x, weight, conv_state, slots)

        return run

    report["decode_conv_9_layers"] = side_by_side(
        f"decode conv update x{b} x9",
        conv_step(conv.causal_conv1d_update),
        conv_step(cpu_ext.causal_conv1d_update),
        args.rounds,
        10,
    )

    n = args.prefill_tokens
    lens = [n // 4] * 3 + [n - 3 * (n // 4)]
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    slots = torch.randperm(num_slots)[:4]
    has_init = torch.tensor([False, True, False, True])
    pq, pk, pv, pg, pbeta = delta_inputs(n)

    def prefill_delta(fn):
        return lambda: fn(
            pq,
            pk,
            pv,
            pg,
            pbeta,
            ssm_state=pool,
            query_start_loc=qsl,
            state_indices=slots,
            has_initial_state=has_init,
            scale=DK**-0.5,
        )

    report["prefill_delta_rule_1_layer"] = side_by_side(
        f"prefill delta rule {n} tok",
        prefill_delta(delta_rule.chunk_gated_delta_rule),
        prefill_delta(cpu_ext.chunk_gated_delta_rule),
        args.rounds,
        1,
    )

    px = torch.randn(n, CONV_DIM + 1024 + 2 * HEADS)[:, :CONV_DIM]

    def prefill_conv(fn):
        return lambda: fn(
            px,
            weight,
            conv_state,
            query_start_loc=qsl,
            state_indices=slots,
            has_initial_state=has_init,
        )

    report["prefill_conv_1_layer"] = side_by_side(
        f"prefill conv {n} tok",
        prefill_conv(conv.causal_conv1d),
        prefill_conv(cpu_ext.causal_conv1d),
        args.rounds,
        2,
    )
    report["machine_load_end"] = machine_load()
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
