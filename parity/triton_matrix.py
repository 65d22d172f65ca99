"""Every Triton kernel variant built under every supported Triton, with no GPU.

    python -m parity.triton_matrix [--tritons 3.6.0,3.7.1] [--arch 80,90] [--envs DIR]
        [--no-tests]

For each Triton of `SUPPORTED`: `parity.compiled` builds every variant of every kernel family
to cubin for each arch (one process per arch, side by side), and the rows are checked as
the kernels' contract asks (`problems`); then `TESTS` run: one interpreter case per gate
kind of each family, and the GPU kit's sweep candidates built. The Triton this Python has
runs here; each other one runs in a virtual environment made under `--envs` (torch's CPU
build, that Triton, numpy, pytest; kept for the next run). Every failure is printed with
its Triton, arch, kernel and variant; exit 1 if there is any. CI runs it beside the tests
(README, "Supported versions").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The Triton versions the kernels are built under: what torch 2.11/2.12 (3.6) and
# torch 2.13 (3.7) pin on CUDA. pyproject.toml's triton requirement and README's
# support matrix say the same (tests/test_triton_matrix.py holds them together).
SUPPORTED = ("3.6.0", "3.7.1")
TORCH_CPU = "torch==2.13.0+cpu"  # pins no Triton: any of SUPPORTED installs beside it
ARCHS = (80, 90)

# Most spilled bytes a variant may have, per family (the kernel name's prefix) and arch,
# built with a real launch's alignment hints; an arch not listed is reported, not held.
# The fused kernels: none on sm_90; 8 B on sm_80 (the gv backward with hints). The chunked
# ones: 256 B on sm_90 (the fp32 FMA products and the every-flag K = V = 64 variants; the
# bf16/fp16 configurations none: tests/test_compiled_report.py); on sm_80 the every-gate
# 16-bit dq/dk spills (the readiness report's sm_80 rows), not held. fused_chunk: none on
# sm_90; on sm_80 its every-gate K = V = 64 bf16 forward split into segments (8 B, outside
# the chunk loop); fp32 splits K past 64 and sm_80 takes 16-token chunks where 32 spilled
# (fused_chunk.config).
SPILL_LIMIT = {"fused_recurrent": {80: 8, 90: 0}, "chunk": {90: 256},
               "fused_chunk": {80: 8, 90: 0}}
# Wide heads (a variant K<k>-V<v>-... with k or v past WIDE) are held to no spills instead:
# their plans take narrower blocks there (fused_chunk.config's K split, chunk.WIDE_K), and
# every kernel of every family then fits its registers, but the chunked dq/dk with every
# gate in 16 bits on sm_80 (the ordinary-K spill above, smaller there), not held.
WIDE = 256
WIDE_SPILL_LIMIT = {"fused_recurrent": {80: 0, 90: 0}, "chunk": {90: 0},
                    "fused_chunk": {80: 0, 90: 0}}
MAX_REGS = 255

# One interpreter case per gate kind of each family, fp32 and one 16-bit case (the
# interpreter shim's bf16 dot) each; fused_chunk's split forward on every gate, varlen; and
# the GPU kit's sweep candidates built for sm_80 and sm_90 (bridge/tuning.py); fused_chunk's
# 16-bit plans built for sm_90, held to no spills, and its 16-bit forward for sm_80 and sm_90,
# held to the plans known to spill (SPEC.md); its dv walk on sm_90 with masked keys and on
# sm_80, held to no spills.
_GATES = ("plain", "g-head", "g-key", "gk", "gv", "gamma-head", "gamma-seq", "reverse", "varlen",
          "everything")
TESTS = tuple(f"tests/test_triton_{fam}.py::test_features_fp32[{g}]"
              for fam in ("fused", "chunk", "fused_chunk") for g in _GATES) + (
    "tests/test_triton_fused.py::test_low_precision[everything-bfloat16]",
    "tests/test_triton_chunk.py::test_low_precision[bfloat16-20]",
    "tests/test_triton_fused_chunk.py::test_low_precision[bfloat16-20]",
    "tests/test_fused_chunk_split.py::test_split_matches_oracle_and_unsplit[varlen-everything]",
    "tests/test_tuning.py::test_candidates_build_ahead_of_time_for_sm80_and_sm90",
    "tests/test_compiled_build.py::test_fused_chunk_16bit_plans_build_without_spills_on_sm90",
    "tests/test_compiled_build.py::test_fused_chunk_16bit_forward_spills_only_where_known",
    "tests/test_compiled_build.py::"
    "test_fused_chunk_dv_walk_with_masked_keys_builds_without_spills_on_sm90",
    "tests/test_compiled_build.py::test_fused_chunk_walks_build_without_spills_on_sm80")


def family(kernel: str) -> str:
    """The family of a kernel, by its name's prefix (`SPILL_LIMIT`'s keys)."""
    return next((f for f in SPILL_LIMIT if kernel.startswith(f + "_")), kernel)


def wide(variant: str) -> bool:
    """Whether a variant's label names a head dim past WIDE (build.variants' K<k>-V<v>-...)."""
    m = re.match(r"K(\d+)-V(\d+)", variant)
    return bool(m) and max(int(m[1]), int(m[2])) > WIDE


def kernel_names() -> set:
    """Every `@triton.jit` kernel of bridge/kernels (a function named *_kernel)."""
    found = set()
    for path in (ROOT / "bridge" / "kernels").glob("*.py"):
        found |= set(re.findall(r"^@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text(),
                                flags=re.M))
    return found


def problems(rows: list, triton: str, archs=ARCHS, kernels=None) -> list:
    """What is wrong with `parity.compiled --json` rows: one line per failing variant, naming
    the Triton, arch, kernel and variant, and one per kernel of `kernels` (default: all
    of bridge/kernels) that no row of an arch built."""
    out, kernels = [], kernel_names() if kernels is None else kernels
    for arch in archs:
        built = {r["kernel"] for r in rows if r["arch"] == arch}
        out += [f"triton {triton} sm_{arch} {k}: no variant built"
                for k in sorted(kernels - built)]
    for r in rows:
        where = f"triton {triton} sm_{r['arch']} {r['kernel']} [{r['variant']}, {r['stage']}]"
        if not r["ok"]:
            out.append(f"{where}: {r.get('error') or 'shared memory %s B' % r.get('shared')}")
            continue
        if not r.get("regs") or r["regs"] > MAX_REGS:
            out.append(f"{where}: registers {r.get('regs')} (at most {MAX_REGS})")
        limits = WIDE_SPILL_LIMIT if wide(r["variant"]) else SPILL_LIMIT
        limit = limits.get(family(r["kernel"]), {}).get(r["arch"])
        if limit is not None and (r.get("spill_bytes") or 0) > limit:
            out.append(f"{where}: spills {r['spill_bytes']} B (at most {limit})")
    return out


def python_for(version: str, envs: Path, log) -> str:
    """A Python with Triton `version`: this one if it has it, else a virtual environment
    under `envs` (made on first use)."""
    try:
        import triton

        if triton.__version__ == version:
            return sys.executable
    except ImportError:
        pass
    env = envs / f"triton-{version}"
    py = env / "bin" / "python"
    check = [str(py), "-c", "import triton, sys; sys.exit(triton.__version__ != %r)" % version]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return str(py)
    log(f"triton {version}: making {env}")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    TORCH_CPU, f"triton=={version}", "numpy", "pytest"], check=True)
    return str(py)


def build(py: str, archs, cache: str, out_dir: Path) -> tuple[list, list]:
    """parity.compiled's variant build of every family under `py`, one process per arch at
    once: (rows, [(arch, return code, output tail)] of the processes that failed to run)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=cache,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {}
    for arch in archs:
        out = out_dir / f"sm_{arch}.json"
        cmd = [py, "-m", "parity.compiled", "--arch", str(arch), "--family", "all", "--hints",
               "--json", str(out)]
        procs[arch] = (out, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True))
    rows, broken = [], []
    for arch, (out, p) in procs.items():
        text = p.communicate()[0]
        if out.exists():
            rows += json.loads(out.read_text())
        else:  # the build itself died: no rows to name
            broken.append((arch, p.returncode, text[-3000:]))
    return rows, broken


def run_tests(py: str) -> subprocess.CompletedProcess:
    """`TESTS` under `py`, in the interpreter (the candidate build compiles itself)."""
    env = dict(os.environ, TRITON_INTERPRET="1", GLA_MATRIX="1", GLA_SLOW="1")
    return subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tritons", default=",".join(SUPPORTED),
                    help="comma-separated Triton versions (default: %(default)s)")
    ap.add_argument("--arch", default=",".join(map(str, ARCHS)), help="CUDA archs")
    ap.add_argument("--envs", default=str(ROOT / ".venv-tritons"),
                    help="where the other Tritons' virtual environments live")
    ap.add_argument("--no-tests", action="store_true", help="build only")
    args = ap.parse_args(argv)
    archs = [int(a) for a in args.arch.replace("sm_", "").split(",") if a]
    log = lambda s: print(s, flush=True)
    failures = []
    for version in [v for v in args.tritons.split(",") if v]:
        t0 = time.time()
        py = python_for(version, Path(args.envs), log)
        with tempfile.TemporaryDirectory() as tmp:
            rows, broken = build(py, archs, os.path.join(tmp, "cache"), Path(tmp))
        bad = problems(rows, version, archs) + [
            f"triton {version} sm_{arch}: parity.compiled ended with {rc} and wrote no "
            f"rows:\n{tail}"
            for arch, rc, tail in broken]
        log(f"triton {version}: {len(rows)} variants built for sm_{'/sm_'.join(map(str, archs))}"
            f", {len(bad)} problems ({time.time() - t0:.0f} s)")
        if not args.no_tests:
            t1 = time.time()
            res = run_tests(py)
            summary = (res.stdout.strip().splitlines() or ["no output"])[-1]
            log(f"triton {version}: tests, {len(TESTS)} cases: {summary} "
                f"({time.time() - t1:.0f} s)")
            if res.returncode:
                bad.append(f"triton {version} tests:\n{res.stdout[-4000:]}"
                           f"{res.stderr[-2000:]}")
        for line in bad:
            log("FAIL " + line)
        failures += bad
    log(f"triton matrix: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
