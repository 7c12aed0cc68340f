"""A speech LM's decode step at 1, 4 and 8 sequences: the CPU kernels against the torch reference.

On a speech LM of a few million parameters (the default voice's) a decode step is mostly the
Python and dispatch around its operators, so this is where a change to the model code, the
kernels' wrappers, the sampler or the step's metadata shows. Two engines hold the same requests
(the voice's phoneme prompts, decoded greedily under a forced duration schedule, so each makes
exactly `--tokens` tokens), one built on the CPU's `Ops` (compiled kernels) and one on
`REFERENCE_OPS` (torch alone). They live in one process and step in lockstep, alternating which
goes first, so a machine shared with other work slows both alike (as `bench.phoneme_sync`).
Per batch size: each side's median step over the runs, the ratio reference / compiled, and
where the compiled step goes (the model's forward, the LM head, the sampler, the step's
metadata; the rest is the scheduler and bookkeeping), medians of as many runs of its own.

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


def engines(args, seqs: int, prompts, speech, end, reference: bool = True) -> dict:
    """The compiled and (`reference`) the reference engine, holding the same `seqs` requests."""
    from kernels import ops as ops_table

    def make():
        return build(args.model, seqs, args.tokens, True, prompts[:seqs], speech, end, 0.0)

    if not reference:
        return {"compiled": make()}
    cpu = ops_table.get_ops("cpu")
    try:  # the model takes its ops table once, when it is built
        ops_table._chosen["cpu"] = ops_table.REFERENCE_OPS
        reference = make()
    finally:
        ops_table._chosen["cpu"] = cpu
    return {"compiled": make(), "reference": reference}


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
    timed(runner, "sampler", "sampler")
    timed(runner, "_prepare", "metadata")
    total = lockstep([("compiled", engine)], expected)["compiled"]
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
        steps: dict[str, list[float]] = {"compiled": [], "reference": []}
        for r in range(args.runs):
            order = list(engines(args, seqs, prompts, speech, end).items())
            spent = lockstep(order if r % 2 else order[::-1], expected)
            for name, (wall, _cpu, n) in spent.items():
                steps[name].append(1e3 * wall / n)
            print(
                f"{seqs} seqs: compiled {steps['compiled'][-1]:.3f} ms  reference "
                f"{steps['reference'][-1]:.3f} ms a step",
                file=sys.stderr,
                flush=True,
            )
        compiled, reference = (statistics.median(steps[k]) for k in ("compiled", "reference"))
        split = [
            parts(engines(args, seqs, prompts, speech, end, reference=False)["compiled"], expected)
            for _ in range(args.runs)
        ]
        result[f"seqs_{seqs}"] = {
            "compiled_step_ms": round(compiled, 4),
            "reference_step_ms": round(reference, 4),
            "reference_vs_compiled": round(reference / compiled, 4),
            "compiled_parts_ms": {
                part: round(statistics.median(r[part] for r in split), 4) for part in split[0]
            },
        }
    result["load_after"] = machine_load()
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
