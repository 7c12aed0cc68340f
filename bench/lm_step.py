"""A speech LM's decode step at 1, 4 and 8 sequences: replayed graphs, eager compiled kernels,
the torch reference.

On a speech LM of a few million parameters (the default voice's) a decode step is mostly the
Python and dispatch around its operators, so this is where a change to the model code, the
kernels' wrappers, the sampler or the step's metadata shows. Three engines hold the same
requests (the voice's phoneme prompts, decoded greedily under a forced duration schedule, so
each makes exactly `--tokens` tokens): `graphs` replays its decode steps from graphs captured
per batch size (text_service.decode_graphs, the engine's default on CPU), `eager` runs the same
compiled kernels (the CPU's `Ops`) through the modules, `reference` runs `REFERENCE_OPS` (torch
alone) eagerly. They live in one process and step in lockstep, rotating which goes first, so a
machine shared with other work slows all alike (as `bench.phoneme_sync`). Per batch size: each
engine's median step over the runs, the ratios eager / graphs and reference / graphs, and where
each compiled engine's step goes (the replayed graph, or the model's forward and LM head; the
sampler, the step's metadata; the rest is the scheduler and bookkeeping), medians of as many
runs of its own.

    python -m bench.lm_step [--model voices/default/lm] [--seqs 1,4,8] [--tokens 160] [--runs 5] [--json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from bench.phoneme_sync import _prompts, build, lockstep, parser, voice_tokens
from bench.workload import machine_load


def engines(args, seqs: int, prompts, speech, end, only: str | None = None) -> dict:
    """The `graphs`, `eager` and `reference` engines (or the one named `only`), each holding the
    same `seqs` requests."""
    from kernels import ops as ops_table

    def make(graphs: int):
        return build(args.model, seqs, args.tokens, True, prompts[:seqs], speech, end, 0.0, graphs)

    def reference():
        cpu = ops_table.get_ops("cpu")
        try:  # the model takes its ops table once, when it is built
            ops_table._chosen["cpu"] = ops_table.REFERENCE_OPS
            return make(0)
        finally:
            ops_table._chosen["cpu"] = cpu

    makers = {"graphs": lambda: make(8), "eager": lambda: make(0), "reference": reference}
    return {name: maker() for name, maker in makers.items() if only in (None, name)}


def parts(engine, expected: int) -> dict[str, float]:
    """Milliseconds per step in each part of the engine's steps (wrapped, so a run of its own)."""
    runner, spent = engine.runner, defaultdict(float)

    def timed(obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] += time.perf_counter() - start

        setattr(obj, name, wrapper)

    timed(runner.model, "compute_logits", "lm_head")
    timed(runner.model, "forward", "forward")
    for graph in runner.graphs.graphs.values():
        timed(graph.module, "forward", "graph")
    timed(runner, "sampler", "sampler")
    timed(runner, "_prepare", "metadata")
    total = lockstep([("engine", engine)], expected)["engine"]
    steps = total[2]
    out = {label: 1e3 * s / steps for label, s in spent.items()}
    out["rest"] = 1e3 * total[0] / steps - sum(out.values())
    return out


def main() -> None:
    args = parser(__doc__, "1,4,8").parse_args()
    torch.set_num_threads(args.threads)
    speech, end = voice_tokens(args.model)
    sizes = [int(s) for s in args.seqs.split(",")]
    prompts = _prompts(f"{args.model}/tokenizer.json", max(sizes))
    result: dict = {"threads": args.threads, "tokens_per_seq": args.tokens, "runs": args.runs}
    result["load_before"] = machine_load()
    for seqs in sizes:
        expected = seqs * args.tokens
        lockstep(list(engines(args, seqs, prompts, speech, end).items()), expected)  # warm-up
        steps: dict[str, list[float]] = defaultdict(list)
        for r in range(args.runs):
            order = list(engines(args, seqs, prompts, speech, end).items())
            spent = lockstep(order[r % 3 :] + order[: r % 3], expected)
            for name, (wall, _cpu, n) in spent.items():
                steps[name].append(1e3 * wall / n)
            print(
                f"{seqs} seqs: "
                + "  ".join(f"{name} {steps[name][-1]:.3f} ms" for name, _ in order)
                + " a step",
                file=sys.stderr,
                flush=True,
            )
        median = {name: statistics.median(v) for name, v in steps.items()}
        entry: dict = {f"{name}_step_ms": round(v, 4) for name, v in median.items()}
        entry["eager_vs_graphs"] = round(median["eager"] / median["graphs"], 4)
        entry["reference_vs_graphs"] = round(median["reference"] / median["graphs"], 4)
        for name in ("graphs", "eager"):
            split = [
                parts(engines(args, seqs, prompts, speech, end, only=name)[name], expected)
                for _ in range(args.runs)
            ]
            labels = sorted({label for r in split for label in r})
            entry[f"{name}_parts_ms"] = {
                label: round(statistics.median(r.get(label, 0.0) for r in split), 4)
                for label in labels
            }
        result[f"seqs_{seqs}"] = entry
    result["load_after"] = machine_load()
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
