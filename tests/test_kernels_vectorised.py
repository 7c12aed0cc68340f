"""The CPU kernels' hot loops are vectorised by the compiler for AVX2 and for AVX-512.

A loop that gcc leaves scalar still gives the right numbers, so no other test sees it, and it can
cost 8x: without AVX-512's masked operations, gcc would not vectorise a loop over the clamped
exponential (silu, softmax) while floating-point traps were on, and an AVX2 machine ran those
loops scalar until `-fno-trapping-math` (bench/README.md, sixteenth pass). Each source line that
gcc reports for such a loop carries the comment `simd-checked`; this test compiles every kernel
source with the extension's own flags for `x86-64-v3` (AVX2 + FMA) and `x86-64-v4` (AVX-512)
and checks, in gcc's `-fopt-info-vec-optimized` report, that every marked line was vectorised.
No timing is involved. Needs gcc on an x86-64 machine (the project's CI machines).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels import cpu_ext

MARK = "simd-checked"
TARGETS = ("x86-64-v3", "x86-64-v4")
SOURCES = [s for s in cpu_ext._SOURCES if MARK in s.read_text()]
CXX = os.environ.get("CXX", "c++")

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which(CXX) is None,
    reason="needs a C++ compiler targeting x86-64",
)


def marked_lines(source: Path) -> set[int]:
    lines = source.read_text().splitlines()
    return {n for n, line in enumerate(lines, 1) if MARK in line}


def vectorised_lines(source: Path, target: str) -> set[int]:
    """Lines of `source` where gcc reports a vectorised loop, built for `target`."""
    from torch.utils import cpp_extension

    flags = [f for f in cpu_ext._CFLAGS if not f.startswith("-march=")]
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    cmd = [
        CXX,
        "-std=c++20",
        f"-march={target}",
        *flags,
        "-fPIC",
        *(f"-isystem{path}" for path in includes),
        "-c",
        str(source),
        "-o",
        os.devnull,
        "-fopt-info-vec-optimized",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.findall(
        rf"^{re.escape(str(source))}:(\d+):\d+: optimized: loop vectorized",
        done.stderr,
        re.MULTILINE,
    )
    return {int(n) for n in found}


def test_the_kernels_mark_their_hot_loops() -> None:
    names = {s.name for s in SOURCES}
    assert {"elementwise_cpu.cpp", "paged_attention_cpu.cpp", "causal_conv1d_cpu.cpp"} <= names


def test_every_marked_loop_is_vectorised_for_avx2_and_avx512() -> None:
    jobs = [(source, target) for source in SOURCES for target in TARGETS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        reports = list(pool.map(lambda job: vectorised_lines(*job), jobs))
    scalar = [
        f"{source.name}:{line} ({target})"
        for (source, target), vectorised in zip(jobs, reports)
        for line in sorted(marked_lines(source) - vectorised)
    ]
    assert not scalar, "loops left scalar: " + ", ".join(scalar)
