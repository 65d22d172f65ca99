"""BENCHMARKS.md's "GPU readiness (compiled, not run)" section: the AOT report
(`python -m bridge.aot --report`) of both Triton kernel families at the reference
shape, bf16, with the lower bounds it derives, next to flash-linear-attention's
published timings. Compiling needs no GPU, so every run of the benchmark can
refresh it; nothing in it is a measured time."""

import json
import os
import subprocess
import sys

SHAPE = (8, 4096, 16, 128, 128)  # B, T, H, K, V
RUNS = (("chunk", "key"), ("fused_recurrent", "key"), ("chunk", "all"))

# flash-linear-attention's README (chunk_gla, bf16, on a GB200; ms, fwd / fwd+bwd).
# No A100/H100 figures are published.
FLA_GB200 = [((4, 2048, 16, 128), 0.514, 1.434), ((2, 16384, 16, 128), 1.445, 5.984),
             ((1, 8192, 96, 128), 1.765, 7.670), ((8, 2048, 32, 256), 2.897, 13.797)]


def run(log=print) -> list:
    """The report of each (mode, gates) of RUNS, from subprocesses in compiled mode."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = []
    for mode, gates in RUNS:
        cmd = [sys.executable, "-m", "bridge.aot", "--report", "--shape", ",".join(map(str, SHAPE)),
               "--dtype", "bf16", "--mode", mode, "--gates", gates, "--arch", "80,90", "--json"]
        log(f"readiness: {' '.join(cmd[1:])}")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if not proc.stdout.startswith("{"):
            raise SystemExit(f"bridge.aot --report failed: {proc.stderr[-2000:]}")
        out.append(json.loads(proc.stdout))
    return out


def section(reports) -> str:
    """The markdown section (a one-line note when no report was made)."""
    if not reports:
        return "not generated in this run (`python -m parity.bench --readiness` makes it)."
    from bridge import aot

    B, T, H, K, V = SHAPE
    lines = [f"Compiled ahead of time for sm_80 and sm_90 (no GPU has run these kernels); "
             f"(B,T,H,K,V) = ({B},{T},{H},{K},{V}), bf16. The lower bound of a launch is "
             "max(tl.dot FLOPs / 989 TFLOP/s, HBM bytes / 3.35 TB/s), an H100 SXM roofline "
             "(67 TFLOP/s fp32 where the PTX has no tensor-core instruction); no timing of ours "
             "exists. Workspace: what the backward allocates beyond the gradients it returns.", "",
             "| mode | gates | fwd bound ms | bwd bound ms | fwd+bwd ms | backward workspace GB "
             "| launches with tl.dot / with tensor cores (sm_80, sm_90) | spilling launches |",
             "|---|---|---|---|---|---|---|---|"]
    for rep in reports:
        b = rep["lower_bound_us"]
        dots = [r for r in rep["launches"] if r["dot_flops"]]
        tc = {t: sum(1 for r in dots if r["target"] == t and (r["mma"] or r["wgmma"]))
              for t in ("sm_80", "sm_90")}
        n = {t: sum(1 for r in dots if r["target"] == t) for t in ("sm_80", "sm_90")}
        spills = sum(1 for r in rep["launches"] if r["n_spills"])
        lines.append(f"| {rep['mode']} | {rep['gates']} | {b['fwd'] / 1e3:.3f} | "
                     f"{b['bwd'] / 1e3:.3f} | {b['total'] / 1e3:.3f} | "
                     f"{rep['workspace_bytes'] / 1e9:.2f} | {n['sm_80']}/{tc['sm_80']}, "
                     f"{n['sm_90']}/{tc['sm_90']} | {spills} |")
    lines += ["", "flash-linear-attention's published `chunk_gla` timings (its README, bf16, "
              "**GB200**, not an H100; ms):", "",
              "| (B,T,H,D) | fwd | fwd+bwd |", "|---|---|---|"]
    lines += [f"| {s} | {f} | {fb} |" for s, f, fb in FLA_GB200]
    lines += ["", "The same token count as our reference shape is (2,16384,16,128): 1.445 / "
              "5.984 ms there. Our figures above are lower bounds, not timings.", ""]
    for rep in reports:
        lines += [f"### {rep['mode']}, gates={rep['gates']}", "", aot.markdown(rep), ""]
    return "\n".join(lines)
