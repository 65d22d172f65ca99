"""The Triton support matrix (`python -m parity.triton_matrix`, which CI runs after the tests):
its checks name what fails, and README, pyproject.toml and the matrix state the same
versions. The builds themselves run in that CI step, not here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from parity import triton_matrix as tm

ROOT = Path(__file__).resolve().parents[1]


def row(kernel, variant="plain", arch=90, **kw):
    return dict(dict(kernel=kernel, variant=variant, stage="fwd", arch=arch, ok=True,
                     shared=1024, regs=128, spill_bytes=0), **kw)


def test_problems_name_the_triton_arch_kernel_and_variant():
    kernels = {"chunk_state_kernel", "fused_recurrent_fwd_kernel"}
    clean = [row(k, arch=a) for k in kernels for a in (80, 90)]
    assert tm.problems(clean, "3.6.0", kernels=kernels) == []
    rows = clean + [
        row("chunk_state_kernel", "gv", ok=False, error="CompilationError: at 10:4"),
        row("chunk_state_kernel", "K128-V128", spill_bytes=257),  # chunk: at most 256 B
        row("chunk_state_kernel", "K64-V64", spill_bytes=256),
        row("chunk_state_kernel", "all-bfloat16", arch=80, spill_bytes=900),  # not held
        row("fused_recurrent_fwd_kernel", "gv", arch=80, spill_bytes=8),
        row("fused_recurrent_fwd_kernel", "gqa", arch=90, spill_bytes=8),  # fused sm_90: none
        row("fused_recurrent_fwd_kernel", "gk", regs=None),  # not reported: a failure
    ]
    got = tm.problems(rows, "3.6.0", kernels=kernels)
    assert got == [
        "triton 3.6.0 sm_90 chunk_state_kernel [gv, fwd]: CompilationError: at 10:4",
        "triton 3.6.0 sm_90 chunk_state_kernel [K128-V128, fwd]: spills 257 B (at most 256)",
        "triton 3.6.0 sm_90 fused_recurrent_fwd_kernel [gqa, fwd]: spills 8 B (at most 0)",
        "triton 3.6.0 sm_90 fused_recurrent_fwd_kernel [gk, fwd]: registers None (at most 255)",
    ]
    # wide heads: no spills, on sm_80 too but in the chunked family; K256-V256 is not wide
    wide = [row("chunk_state_kernel", "K320-V96-head-gv-bf16", spill_bytes=8),
            row("chunk_state_kernel", "K512-V512-all-bf16", arch=80, spill_bytes=64),
            row("chunk_state_kernel", "K256-V256", spill_bytes=8),
            row("fused_recurrent_fwd_kernel", "K300-V96-key-gk-fp32", arch=80, spill_bytes=8)]
    assert tm.problems(clean + wide, "3.7.1", kernels=kernels) == [
        "triton 3.7.1 sm_90 chunk_state_kernel [K320-V96-head-gv-bf16, fwd]: spills 8 B "
        "(at most 0)",
        "triton 3.7.1 sm_80 fused_recurrent_fwd_kernel [K300-V96-key-gk-fp32, fwd]: spills 8 B "
        "(at most 0)"]
    # a kernel no row built is named too
    assert tm.problems([row("chunk_state_kernel")], "3.7.1", archs=(90,), kernels=kernels) == [
        "triton 3.7.1 sm_90 fused_recurrent_fwd_kernel: no variant built"]


def test_every_kernel_of_both_families_is_listed():
    names = tm.kernel_names()
    assert {"fused_recurrent_fwd_kernel", "fused_recurrent_bwd_dkv_kernel",
            "chunk_state_kernel", "chunk_dqk_kernel"} <= names
    assert all(tm.family(n) in tm.SPILL_LIMIT or not n.startswith(("chunk_", "fused_"))
               for n in names)


def test_readme_and_pyproject_state_the_matrix():
    """pyproject's triton bounds admit each supported Triton and no other minor series;
    README's support table and the bounds it quotes say the same."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'"triton>=(\d+)\.(\d+),<(\d+)\.(\d+)"', pyproject)
    lo, hi = (int(spec[1]), int(spec[2])), (int(spec[3]), int(spec[4]))
    minors = sorted({tuple(map(int, v.split(".")[:2])) for v in tm.SUPPORTED})
    assert minors[0] == lo and (minors[-1][0], minors[-1][1] + 1) == hi
    assert minors == [(lo[0], m) for m in range(lo[1], hi[1])]  # no series skipped
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    assert all(v in table for v in tm.SUPPORTED)
    assert f'`triton>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}`' in table


def test_the_interpreter_cases_exist():
    """The matrix's interpreter tests are collected by these node ids (a renamed case
    would make the step fail only in CI)."""
    pytest.importorskip("triton")
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *tm.TESTS], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert f"{len(tm.TESTS)} tests collected" in res.stdout
