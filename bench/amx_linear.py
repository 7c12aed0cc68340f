"""Projections of a benchmark model: oneDNN's packed matmul against the compiled kernel, the AMX
one in bf16 (`--dtype bfloat16`, the default) or the AVX-512 one in fp32 (`--dtype float32`).

Every projection of the model (and its tied LM head) in the order a decode step meets them, at
each row count, with the weights packed once for oneDNN (`kernels.linear.pack_weight`, what the
engine used before) and once in the compiled kernel's layout (`kernels.cpu_ext`); the two are run
in turn, `--repeats` times each, and the best pass of each is reported with the rate it read the
weights at, its GFLOP/s and the ratio. At bf16 decode row counts a projection's time is the time
to stream its weights, so GB/s is the figure to hold against the machine's memory bandwidth; in
fp32 the multiplies bound it from about 16 rows on, so GFLOP/s is held against the matmul peak
measured in the same run (oneDNN on one 512 x 1024 weight that stays in cache, 256 rows, called
again and again). Where the CPU has no compiled kernel for the dtype (bf16 without AMX), the
engine runs oneDNN, and oneDNN alone is timed against that peak.

    python -m bench.amx_linear [--dtype bfloat16|float32] [--kind qwen3] [--rows 1,8,16,32,64,256]
        [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.workload import MODEL_KINDS, machine_load, model_dir


def model_weights(kind: str) -> list[torch.Tensor]:
    """The bf16 model's projection weights as loaded, then its LM head (the embeddings if tied)."""
    from text_service.loader import load_model
    from text_service.models.layers import Linear

    model = load_model(model_dir(kind, "bfloat16"), device="cpu", dtype=torch.bfloat16)
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, Linear)]
    if model.tie_word_embeddings:
        weights.append(model.model.embed_tokens.weight.detach())
    return weights


def time_pass(run, packed: list[torch.Tensor], inputs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for x, w in zip(inputs, packed):
        run(x, w)
    return time.perf_counter() - start


def matmul_peak(dtype: torch.dtype, rows: int = 256, calls: int = 20) -> float:
    """GFLOP/s of oneDNN's packed matmul on one 512 x 1024 weight (1-2 MB: it stays in cache),
    the best of five runs of `calls` calls: this CPU's matmul rate with memory out of the way."""
    from kernels import linear

    w = linear.pack_weight(torch.randn(512, 1024).to(dtype))
    x = torch.randn(rows, 1024).to(dtype)
    linear.onednn_linear(x, w)
    best = min(time_pass(linear.onednn_linear, [w] * calls, [x] * calls) for _ in range(5))
    return 2 * rows * 512 * 1024 * calls / best / 1e9


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=sorted(MODEL_KINDS), default="qwen3")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--rows", default="1,8,16,32,64,256", help="comma-separated row counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6, help="passes of each, in turn")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from kernels import cpu_ext, linear

    dtype = getattr(torch, args.dtype)
    # where the CPU has no kernel for the dtype (bf16 without AMX, fp32 without AVX-512) the
    # engine runs oneDNN's matmul, and oneDNN alone is timed against the peak
    kernel = (
        ("amx" if cpu_ext.amx_linear_available() else None)
        if dtype == torch.bfloat16
        else (f"{cpu_ext.fp32_linear_form()}_fp32" if cpu_ext.fp32_linear_available() else None)
    )
    if not linear.onednn_available():
        raise SystemExit("bench.amx_linear: this torch has no oneDNN matmul")
    torch.set_num_threads(args.threads)
    loaded = [w.to(dtype) for w in model_weights(args.kind)]
    # the projections both pack (a weight under ONEDNN_MIN_MACS stays on F.linear either way), in
    # the kernel's own layout whether or not the engine gives it these weights (on a CPU with
    # AVX2 alone it takes only fp32 weights too small for oneDNN: `cpu_ext.pack_linear_weight`)
    pack = (
        torch.ops.splittts_kernels.fp32_pack_linear_weight
        if dtype == torch.float32 and kernel is not None
        else cpu_ext.pack_linear_weight
    )
    both = [(w, linear.pack_weight(w), pack(w)) for w in loaded]
    both = [(w, o, a) for w, o, a in both if o.is_mkldnn and (kernel is None or a.dim() in (3, 5))]
    weights, onednn, compiled = (list(t) for t in zip(*both))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    macs = sum(w.numel() for w in weights)
    cases = {"onednn": (linear.onednn_linear, onednn)}
    if kernel is not None:
        cases["compiled"] = (cpu_ext.linear, compiled)
    report: dict = {
        "dtype": args.dtype,
        "compiled_kernel": kernel,
        "peak_gflop_per_s": round(matmul_peak(dtype), 1),
        "kind": args.kind,
        "threads": args.threads,
        "projections": len(weights),
        "projections_left_out": len(loaded) - len(weights),
        "weight_mb": round(nbytes / 1e6, 1),
        "machine_load_start": machine_load(),
        "rows": {},
    }
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, w.shape[1]).to(dtype) for w in weights]
        best = {}
        for run, packed in cases.values():  # first calls: primitives, pages, caches
            time_pass(run, packed, inputs)
        passes: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):  # in turn, so that drift hits both alike
            for name, (run, packed) in cases.items():
                passes[name].append(time_pass(run, packed, inputs))
        for name, times in passes.items():
            t = min(times)
            best[name] = {
                "ms": round(t * 1e3, 2),
                "gb_per_s": round(nbytes / t / 1e9, 1),
                "gflop_per_s": round(2 * rows * macs / t / 1e9, 1),
            }
        if kernel is not None:
            best["ratio_compiled_vs_onednn"] = round(
                best["compiled"]["ms"] / best["onednn"]["ms"], 3
            )
        report["rows"][rows] = best
    report["machine_load_end"] = machine_load()
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['projections']} {args.dtype} projections of {args.kind} "
            f"({report['weight_mb']} MB; {report['projections_left_out']} left on F.linear), "
            f"{args.threads} threads, best of {args.repeats}; matmul peak in cache "
            f"{report['peak_gflop_per_s']} GFLOP/s"
        )
        if kernel is None:
            print(f"no compiled {args.dtype} kernel on this CPU: oneDNN alone")
        head = f"{'rows':>6}{'oneDNN ms':>12}{'GB/s':>8}{'GFLOP/s':>9}"
        if kernel is not None:
            head += f"{kernel + ' ms':>16}{'GB/s':>8}{'GFLOP/s':>9}{'ratio':>8}"
        print(head)
        for rows, r in report["rows"].items():
            one = r["onednn"]
            line = f"{rows:>6}{one['ms']:>12.1f}{one['gb_per_s']:>8.1f}{one['gflop_per_s']:>9.0f}"
            if kernel is not None:
                ours = r["compiled"]
                line += (
                    f"{ours['ms']:>16.1f}{ours['gb_per_s']:>8.1f}{ours['gflop_per_s']:>9.0f}"
                    f"{r['ratio_compiled_vs_onednn']:>8.2f}"
                )
            print(line)
        print(f"machine load {report['machine_load_start']} -> {report['machine_load_end']}")
    return report


if __name__ == "__main__":
    main()
