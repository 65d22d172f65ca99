"""`python -m parity.compiled`: the Triton kernels compiled ahead of time, with no GPU.

    TRITON_INTERPRET=0 python -m parity.compiled --arch 90 [--family all] [--json PATH]

builds every launch of `VARIANTS` (through the same launch lists the
frameworks run) to cubin for the given CUDA arch, and prints one line per
kernel variant with its shared memory, registers and spills. Exits 1 if any
variant fails to build or needs more shared memory than the arch has.
`--hints` compiles them with a real launch's alignment hints (off by default:
the known spills in tests/test_triton_*.py were measured without them).

    TRITON_INTERPRET=0 python -m parity.compiled --report [--shape B,T,H,K,V] [--dtype bf16]
        [--mode chunk] [--gates key] [--arch 80,90] [--json [PATH]] [--markdown]
        [--ptx-dir DIR]

compiles the forward and backward launch lists of one call for each arch and
reports, per launch: grid, warps/stages, registers, spills, shared memory,
tensor-core instructions in the PTX (mma.sync / wgmma.mma_async and their
operand types), the launch's dot FLOPs and HBM bytes, and a roofline lower
bound on an H100 SXM; plus the backward's workspace (see `report`). Its SASS
section (parity/compiled/sass.py, trip counts from parity/compiled/tripcounts.py) adds per launch
CTAs per SM, static instructions, every loop with its bar.sync / SHFL /
MUFU.EX2 / cp.async / TMA / MMA counts, and a dynamic warp-instruction estimate;
for mode chunk on sm_90, issue 30's targets met / NOT met (`targets`); and the time
model's table per launch on an H200 and an H100 (parity/compiled/timemodel.py).
"""

import argparse
import json
import os
import sys
import time

from .build import DTYPES, SMEM_LIMIT, compile_launch, for_arch, stages, variants
from .report import GATES, markdown, report

# ---------------------------------------------------------------- command line

def _ints(text):
    return [int(x) for x in str(text).replace("sm_", "").split(",") if x]


def _variant_mode(args, arch):
    from bridge.kernels import chunk, fused_chunk, fused_recurrent

    families = {"fused_recurrent": [fused_recurrent], "chunk": [chunk],
                "fused_chunk": [fused_chunk],
                "all": [fused_recurrent, chunk, fused_chunk]}[args.family]
    rows, failed, built = [], 0, set()
    for label, plan in variants():
        for stage, launches, dtypes in stages(families, plan):
            if stage == "bwd-nodht" and label not in ("plain", "all-float32"):
                continue
            for launch in launches:
                # a kernel variant (its constexprs, warps and argument dtypes) is built
                # once, whichever plan or family asked for it first
                key = (launch.kernel.__name__, repr(sorted(launch.constexprs.items())),
                       launch.num_warps, plan.dtype,
                       tuple(dtypes[n] if n else plan.dtype
                             for _, kind, n in launch.arguments() if kind == "in"))
                if key in built:
                    continue
                built.add(key)
                row = dict(variant=label, stage=stage, kernel=launch.kernel.__name__,
                           arch=arch)
                t0 = time.time()
                try:
                    row.update(compile_launch(launch, plan, arch, bool(args.hints), dtypes))
                    row["ok"] = row["shared"] <= SMEM_LIMIT.get(arch, 99 * 1024)
                except Exception as e:  # report every failure, keep going
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
                row["seconds"] = round(time.time() - t0, 2)
                failed += not row["ok"]
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows, failed


def _write(text, where):
    if where == "-":
        print(text, flush=True)
    else:
        with open(where, "w") as f:
            f.write(text)


def _compare(specs) -> int:
    """The comparison table (and each family's launch table) of saved reports, each
    LABEL=T:REPORT.json."""
    from . import timemodel

    families = {}
    for spec in specs:
        label, rest = spec.split("=", 1)
        T, path = rest.split(":", 1)
        with open(path) as f:
            families[f"{label} {T}"] = (int(T), json.load(f)["launches"])
    print(timemodel.TEXT + "\n\n" + timemodel.compare_markdown(families,
                                                                timemodel.MEASURED_H200))
    for label, (T, recs) in families.items():
        print(f"\n{label}:\n\n" + timemodel.launch_markdown(recs))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", type=_ints,
                    help="CUDA arch, repeatable or a list (80,90); default 90, "
                         "with --report 80 and 90")
    ap.add_argument("--json", nargs="?", const="-",
                    help="write JSON to PATH (no PATH with --report: to stdout)")
    ap.add_argument("--family", choices=("fused_recurrent", "chunk", "fused_chunk", "all"),
                    default="fused_recurrent",
                    help="which kernel family's launch lists to build")
    ap.add_argument("--hints", action=argparse.BooleanOptionalAction, default=None,
                    help="compile with the alignment hints a real launch gets (16-byte "
                         "pointers, ints divisible by 16); default: on with --report, off "
                         "for the variants (their tests' known spills were measured so)")
    ap.add_argument("--report", action="store_true",
                    help="report one call's launches (shape, dtype, mode) instead")
    ap.add_argument("--shape", type=_ints, default=[8, 4096, 16, 128, 128], help="B,T,H,K,V")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--mode", choices=("chunk", "fused_recurrent", "fused_chunk"),
                    default="chunk")
    ap.add_argument("--gates", choices=tuple(GATES), default="key",
                    help="key: GLA's g [B,T,H,K]; head: g [B,T,H]; gamma: g_gamma [H]; "
                         "gv: gv [B,T,H,V]; all: g, gk, gv and g_gamma")
    ap.add_argument("--ptx-dir", help="write <kernel>.<phase>.sm_<arch>.<dtype>.ptx here")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--compare-fla", action="store_true",
                    help="also compile fla 0.6.0's chunk_gla kernels for sm_90 (fla-core, the "
                         "bench extra) at each autotune config; report the cheapest per kernel "
                         "and the targets against them (minutes on a cold Triton cache)")
    ap.add_argument("--fla", action="store_true",
                    help="only fla's kernels (parity.compiled.fla) at --shape / --dtype, as "
                         "JSON (to --json PATH or stdout); what --compare-fla runs")
    ap.add_argument("--compare", nargs="+", metavar="LABEL=T:REPORT.json",
                    help="the time model's comparison table of saved --report / --fla JSON "
                         "outputs (no compiling)")
    args = ap.parse_args(argv)
    if args.compare:
        return _compare(args.compare)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("parity.compiled: run with TRITON_INTERPRET=0 (the interpreter has no "
                 "compiler)")
    os.environ["TRITON_INTERPRET"] = "0"
    if args.fla:
        from .fla import report as fla_only

        rep = fla_only(args.shape, args.dtype,
                       log=lambda s: print(s, file=sys.stderr, flush=True))
        _write(json.dumps(rep, indent=1), args.json or "-")
        return 0
    archs = [a for group in args.arch or [] for a in group]

    if args.report:
        if len(args.shape) != 5:
            ap.error("--shape takes B,T,H,K,V")
        archs = archs or [80, 90]
        rep = report(args.shape, args.dtype, args.mode, archs, args.gates, args.ptx_dir,
                     hints=args.hints is not False,
                     log=lambda s: print(s, file=sys.stderr, flush=True),
                     compare_fla=args.compare_fla)
        text = json.dumps(rep, indent=1)
        if args.json and args.json != "-":
            with open(args.json, "w") as f:
                f.write(text)
        elif args.json:
            print(text, flush=True)
        if args.markdown or not args.json:
            print(markdown(rep), flush=True)
        failed = [r for r in rep["launches"] if "error" in r
                  or r["shared"] > SMEM_LIMIT.get(int(r["target"][3:]), 99 * 1024)]
        return 1 if failed else 0

    rows, failed = [], 0
    for arch in archs or [90]:
        with for_arch(arch):
            r, f = _variant_mode(args, arch)
        rows += r
        failed += f
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    elif args.json:
        print(json.dumps(rows, indent=1))
    print(f"{len(rows) - failed} built, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
