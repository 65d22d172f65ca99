"""BENCHMARKS.md's "GPU readiness" and "TPU readiness (compiled, not run)" sections:
the AOT report (`python -m parity.compiled --report`) of the three Triton kernel
families at the reference shape, bf16 (each arch's own launch lists), with the lower
bounds it derives, next to flash-linear-attention's published timings; the SASS
instruction model of the chunk kernels against fla's own (`--compare-fla`, when
fla-core is installed) with issue 30's targets met / NOT met; and the Mosaic report of
the Pallas kernels (`python -m jax_side.tpu_report`) at the same shape. Compiling needs
no GPU or TPU, so every run of the benchmark can refresh them; nothing in them is a
measured time."""

import json
import os
import subprocess
import sys

SHAPE = (8, 4096, 16, 128, 128)  # B, T, H, K, V
RUNS = (("chunk", "key"), ("fused_recurrent", "key"), ("chunk", "all"),
        ("fused_chunk", "key"))
COMPARED = ("chunk", "key")  # the run compared with fla's chunk_gla (GLA, key gate)

# flash-linear-attention's README (chunk_gla, bf16, on a GB200; ms, fwd / fwd+bwd).
# No A100/H100 figures are published.
FLA_GB200 = [((4, 2048, 16, 128), 0.514, 1.434), ((2, 16384, 16, 128), 1.445, 5.984),
             ((1, 8192, 96, 128), 1.765, 7.670), ((8, 2048, 32, 256), 2.897, 13.797)]


TPU_FNS = ("recurrent_gla", "lightning_attn", "recurrent")


def run(log=print) -> dict:
    """{"gpu": the AOT report of each (mode, gates) of RUNS, "tpu": the Mosaic report of
    each of TPU_FNS}, from subprocesses (the Triton ones in compiled mode)."""
    return {"gpu": gpu_run(log), "tpu": tpu_run(log)}


def tpu_run(log=print) -> list:
    cmd = [sys.executable, "-m", "jax_side.tpu_report", "--shape", ",".join(map(str, SHAPE)),
           "--dtype", "bf16", "--json", "--fn", *TPU_FNS]
    log(f"readiness: {' '.join(cmd[1:])}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not proc.stdout.startswith("["):
        raise SystemExit(f"jax_side.tpu_report failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def gpu_run(log=print) -> list:
    """The report of each (mode, gates) of RUNS, from subprocesses in compiled mode."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = []
    for mode, gates in RUNS:
        cmd = [sys.executable, "-m", "parity.compiled", "--report",
               "--shape", ",".join(map(str, SHAPE)),
               "--dtype", "bf16", "--mode", mode, "--gates", gates, "--arch", "80,90", "--json"]
        if (mode, gates) == COMPARED:
            cmd.append("--compare-fla")
        log(f"readiness: {' '.join(cmd[1:])}")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if not proc.stdout.startswith("{"):
            raise SystemExit(f"parity.compiled --report failed: {proc.stderr[-2000:]}")
        out.append(json.loads(proc.stdout))
    return out


NOT_MADE = "not generated in this run (`python -m parity.bench --readiness` makes it)."


def _reports(readiness, kind):
    """The stored reports of `kind` ("gpu" or "tpu"); a plain list is an older record
    holding the GPU reports only."""
    if isinstance(readiness, dict):
        return readiness.get(kind)
    return readiness if kind == "gpu" else None


def tpu_section(readiness) -> str:
    """The TPU markdown section (a one-line note when no report was made)."""
    reports = _reports(readiness, "tpu")
    if not reports:
        return NOT_MADE
    from jax_side import tpu_report

    B, T, H, K, V = SHAPE
    lines = [f"Exported for platform \"tpu\" from this CPU host (`jax.export`, the real Mosaic "
             f"lowering; Mosaic's final compile happens only on a TPU, and **no TPU has run "
             f"these kernels: no TPU timing exists**); (B,T,H,K,V) = ({B},{T},{H},{K},{V}), "
             "bf16, through the public functions with `platform=\"pallas\"`. Per launch: the "
             "`tpu.matmul` ops of its Mosaic module (how many take bf16 operands, how many "
             "produce >= 64 rows), the VMEM of its double-buffered blocks and scratch "
             "(temporaries not counted), its `pl.CostEstimate`, the MXU FLOPs read from the "
             "module times the grid, and a lower bound max(MXU time, HBM bytes / bandwidth) "
             "with bf16 products at the chip's peak and fp32 (HIGHEST) products as six bf16 "
             "passes: TPU v5e 197 TFLOP/s, 819 GB/s; v5p 459 TFLOP/s, 2.76 TB/s (per chip). "
             "Exponentials (EUP) and vector work are not in the bound.", "",
             "| function | fwd bound v5e / v5p ms | fwd+bwd bound v5e / v5p ms | Mosaic kernels "
             "fwd / fwd+bwd | tpu.matmul fwd+bwd (bf16 / >= 64 rows) |", "|---|---|---|---|---|"]
    for rep in reports:
        f, fb = rep["passes"]["forward"], rep["passes"]["fwd+bwd"]
        n = sum(r["matmuls"] for r in fb["launches"])
        nb = sum(r["bf16_matmuls"] for r in fb["launches"])
        nr = sum(r["rows64_matmuls"] for r in fb["launches"])
        lines.append(f"| {rep['fn']} | {f['lower_bound_us']['v5e'] / 1e3:.3f} / "
                     f"{f['lower_bound_us']['v5p'] / 1e3:.3f} | "
                     f"{fb['lower_bound_us']['v5e'] / 1e3:.3f} / "
                     f"{fb['lower_bound_us']['v5p'] / 1e3:.3f} | {f['tpu_custom_calls']} / "
                     f"{fb['tpu_custom_calls']} | {n} ({nb} / {nr}) |")
    lines.append("")
    for rep in reports:
        lines += [f"### {rep['fn']}", "", tpu_report.markdown(rep), ""]
    return "\n".join(lines)


def section(readiness) -> str:
    """The GPU markdown section (a one-line note when no report was made)."""
    reports = _reports(readiness, "gpu")
    if not reports:
        return NOT_MADE
    from parity.compiled import report

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
    lines += instruction_model(reports)
    for rep in reports:
        lines += [f"### {rep['mode']}, gates={rep['gates']}", "", report.markdown(rep, "sm_90"), ""]
    return "\n".join(lines)


def _side(recs, target="sm_90") -> dict:
    """Per phase: dynamic warp-instructions, worst loop body's bar.sync, fewest
    CTAs per SM among the parallel kernels, spilling launches."""
    from parity.compiled import report

    out = {}
    for phase in ("fwd", "bwd"):
        rs = [r for r in recs if r["phase"] == phase and r.get("target") == target and "loops" in r]
        par = [r for r in rs if not report.sequential(r["kernel"])]
        worst = max(rs, key=report.max_loop_bars, default=None)
        few = min(par, key=lambda r: r["ctas_per_sm"], default=None)
        out[phase] = dict(
            dynamic=sum(r["dynamic"] for r in rs),
            bars=f"{report.max_loop_bars(worst)} ({worst['kernel']})" if worst else "-",
            ctas=f"{few['ctas_per_sm']} ({few['kernel']})" if few else "-",
            spills=sum(1 for r in rs if r["n_spills"]))
    return out


def instruction_model(reports) -> list:
    """The "Instruction model" lines: ours against fla's chunk_gla, sm_90, and the
    targets of the compared run."""
    from parity.compiled import report

    rep = next((r for r in reports if (r["mode"], r["gates"]) == COMPARED), None)
    if rep is None or not rep.get("targets"):
        return []
    B, T, H, K, V = SHAPE
    lines = ["### Instruction model: ours against fla's chunk_gla (sm_90, GLA key gate)", "",
             f"SASS read without a GPU (see the SASS tables below for the method): dynamic "
             f"warp-instructions at (B,T,H,K,V) = ({B},{T},{H},{K},{V}) bf16, the most bar.sync "
             "in one loop body (nested loops included), the fewest CTAs per SM among the "
             "parallel kernels (ours: all but the state passes; fla: all but chunk_*_h), and "
             "launches that spill. An estimate of issued instructions, not a time.", ""]
    fla = rep.get("fla") or {}
    ours = _side(rep["launches"])
    theirs = _side(fla.get("launches") or [])
    lines += ["| phase | ours: dyn warp-instr G | fla: dyn warp-instr G | ours / fla | "
              "ours: max BAR in a loop | fla: max BAR in a loop | ours: min CTAs/SM | "
              "fla: min CTAs/SM | spilling launches ours / fla |", "|---" * 9 + "|"]
    for phase in ("fwd", "bwd"):
        o, t = ours[phase], theirs[phase]
        ratio = f"{o['dynamic'] / t['dynamic']:.2f}x" if t["dynamic"] else "-"
        fdyn = f"{t['dynamic'] / 1e9:.3f}" if t["dynamic"] else "-"
        lines.append(f"| {phase} | {o['dynamic'] / 1e9:.3f} | {fdyn} | {ratio} | {o['bars']} | "
                     f"{t['bars']} | {o['ctas']} | {t['ctas']} | {o['spills']} / "
                     f"{t['spills'] if fla.get('launches') else '-'} |")
    if fla.get("error"):
        lines += ["", f"fla: {fla['error']}"]
    lines += ["", "Issue 30's targets:", "", report.targets_markdown(rep["targets"]), ""]
    return lines
