"""A streamed vocoder forward beside other Python threads, at two GIL switch intervals.

A torch forward of the streaming HiFi-GAN is hundreds of small operators; each gives the GIL up
while it runs and must take it back before the next. A thread running Python keeps the GIL until
the interpreter's switch interval (`sys.setswitchinterval`, 5 ms by default) runs out, so every
operator of a forward beside it can wait that long. The vocoder service has such threads: its
event loop (gRPC, token decoding, job sizing) and a second worker's forward. This measures the
median forward of one stream (bf16 torch, one intra-op thread) alone, beside a second worker
thread, and beside a thread that runs Python without pause, at each interval, side by side.

    python -m bench.vocoder_gil [--frames 16] [--forwards 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import numpy as np
import torch

from vocoder_service.__main__ import DEFAULT_VOICE_DIR, GIL_SWITCH_MS

# Python's default, and the vocoder service's (--gil-switch-ms)
INTERVALS_S = (0.005, GIL_SWITCH_MS / 1e3)


def _forward_times(run, forwards: int, out: list[float]) -> None:
    times = []
    for _ in range(forwards):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    out.append(statistics.median(times))


def _python_busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def measure(run, forwards: int, workers: int, busy: bool) -> float:
    """Median forward (s), averaged over `workers` threads each running forwards."""
    out: list[float] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=_forward_times, args=(run, forwards, out)) for _ in range(workers)
    ]
    spinner = threading.Thread(target=_python_busy, args=(stop,)) if busy else None
    if spinner:
        spinner.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if spinner:
        spinner.join()
    return sum(out) / len(out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=16, help="new mel frames per forward")
    p.add_argument("--forwards", type=int, default=30, help="forwards per thread and case")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from bench.workload import machine_load
    from vocoder_service.backends import TorchBackend
    from vocoder_service.voice import load_voice

    torch.set_num_threads(1)
    backend = TorchBackend(load_voice(DEFAULT_VOICE_DIR).generator, bf16=True)
    rng = np.random.default_rng(0)
    mel = (rng.standard_normal((1, backend.num_mels, args.frames)) * 0.5 - 4).astype(np.float32)
    _, state = backend.run_stream(mel, None)

    def run() -> None:
        backend.run_stream(mel, state)

    for _ in range(5):
        run()
    report: dict = {
        "frames": args.frames,
        "machine_load_start": machine_load(),
        "cases": {},
    }
    before = sys.getswitchinterval()
    names = [f"{interval * 1e3:g} ms" for interval in INTERVALS_S]
    report["cases"] = {name: {} for name in names}
    try:  # each case at both intervals one after the other, so that drift hits both alike
        for case, workers, busy in (
            ("alone", 1, False),
            ("beside a second worker", 2, False),
            ("beside busy Python", 1, True),
        ):
            for name, interval in zip(names, INTERVALS_S):
                sys.setswitchinterval(interval)
                report["cases"][name][case] = 1e3 * measure(run, args.forwards, workers, busy)
    finally:
        sys.setswitchinterval(before)
    default, ours = (report["cases"][f"{i * 1e3:g} ms"] for i in INTERVALS_S)
    report["ratio_service_vs_python"] = {k: ours[k] / default[k] for k in default}
    report["machine_load_end"] = machine_load()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"median forward of {args.frames} new frames (bf16 torch, 1 thread), ms")
        print(f"{'':26}" + "".join(f"{name:>14}" for name in report["cases"]) + f"{'ratio':>10}")
        for case in default:
            print(
                f"{case:26}"
                + "".join(f"{report['cases'][n][case]:>14.1f}" for n in report["cases"])
                + f"{report['ratio_service_vs_python'][case]:>10.2f}"
            )
        print(f"machine load {report['machine_load_start']} -> {report['machine_load_end']}")
    return report


if __name__ == "__main__":
    main()
