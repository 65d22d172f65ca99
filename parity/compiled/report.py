"""The AOT report of one call: its forward and backward launch lists compiled for
each arch (parity.compiled.build), per launch grid, warps, registers, spills, shared
memory, tensor-core instructions, FLOPs, bytes, a roofline lower bound and the SASS
columns; the backward's workspace; the instruction-model targets against fla's
kernels compiled the same way (parity.compiled.fla); the time model's tables
(parity.compiled.timemodel); and their markdown."""

import json
import os
import re
import sys
import time

from .build import (DTYPES, PEAK_FP32_FLOPS, PEAK_HBM_BYTES, PEAK_TC_FLOPS, PEAK_TF32_FLOPS,
                    compile_with_usage, count_mma, for_arch, launch_params, launch_trips,
                    lower_bound, sass_fields, tensor_dtypes, workspace_bytes)

def targets(rep, target="sm_90") -> list:
    """Issue 30's instruction-model targets for the report's `target`, each
    dict(name, met (True/False, None where not measurable), figure). fla's
    figures come from `rep["fla"]` (--compare-fla)."""
    ours = [r for r in rep["launches"] if r["target"] == target and "loops" in r]
    if not ours:
        return []
    fla = rep.get("fla") or {}
    theirs = [r for r in fla.get("launches", ()) if r["target"] == target and "loops" in r]
    why = fla.get("error") or "fla not compiled (--compare-fla, needs fla-core)"
    out = []
    dyn = rep["dynamic_warp_instructions"][target]
    for phase, label in (("fwd", "forward"), ("bwd", "backward")):
        mine = dyn[phase]
        if theirs:
            other = sum(r["dynamic"] for r in theirs if r["phase"] == phase)
            out.append(dict(name=f"dynamic warp-instructions, {label}: ours <= fla's",
                            met=mine <= other,
                            figure=f"{mine / 1e9:.3f}G vs fla {other / 1e9:.3f}G "
                                   f"({mine / other:.2f}x)"))
        else:
            out.append(dict(name=f"dynamic warp-instructions, {label}: ours <= fla's", met=None,
                            figure=f"{mine / 1e9:.3f}G; {why}"))
    worst = max(ours, key=max_loop_bars)
    figure = f"{max_loop_bars(worst)} ({worst['kernel']})"
    if theirs:
        fworst = max(theirs, key=max_loop_bars)
        out.append(dict(name="bar.sync in any loop body <= fla's worst loop body",
                        met=max_loop_bars(worst) <= max_loop_bars(fworst),
                        figure=f"{figure} vs fla {max_loop_bars(fworst)} ({fworst['kernel']})"))
    else:
        out.append(dict(name="bar.sync in any loop body <= fla's worst loop body", met=None,
                        figure=f"{figure}; {why}"))
    parallel = [r for r in ours if not sequential(r["kernel"])]
    low = sorted({(r["kernel"], r["ctas_per_sm"]) for r in parallel if r["ctas_per_sm"] < 2})
    out.append(dict(name="CTAs per SM >= 2 in every parallel kernel (all but the state passes)",
                    met=not low, figure=", ".join(f"{k} {n}" for k, n in low) or ", ".join(
                        sorted({f"{r['kernel']} {r['ctas_per_sm']}" for r in parallel}))))
    if rep["shape"]["K"] <= 128 and rep["shape"]["V"] <= 128:
        spills = sorted({(r["kernel"], r["n_spills"]) for r in ours if r["n_spills"]})
        out.append(dict(name="no spills at K=V<=128", met=not spills,
                        figure=", ".join(f"{k} {b} B" for k, b in spills) or "none"))
    return out


def targets_markdown(ts) -> str:
    word = {True: "met", False: "NOT met", None: "not measured"}
    return "\n".join(["| target (sm_90) | status | figure |", "|---|---|---|"] +
                     [f"| {t['name']} | {word[t['met']]} | {t['figure']} |" for t in ts])


def sequential(kernel: str) -> bool:
    """Whether a kernel is a sequential state pass (ours: *state*; fla: chunk_*_h,
    chunk_*_dh), the kernels the CTAs-per-SM target leaves out."""
    return bool(re.search(r"state|_d?h$", kernel))


def max_loop_bars(rec) -> int:
    """The most bar.sync in one loop body (nested loops' bodies included) of a record."""
    return max((lp["classes_nested"]["BAR"] for lp in rec.get("loops") or ()), default=0)


# ---------------------------------------------------------------- the report

GATES = {"key": dict(g="key"), "head": dict(g="head"), "none": {},
         "gamma": dict(g_gamma="head"), "gv": dict(gv=True),
         "all": dict(g="key", gk=True, gv=True, g_gamma="head")}


def report_plan(shape, dtype="bf16", gates="key"):
    """The Plan of one call at `shape` (B, T, H, K, V), Hk = H, N = B."""
    from bridge.contract import Plan

    B, T, H, K, V = shape
    kw = dict(g="none", gk=False, gv=False, g_gamma="none")
    kw.update(GATES[gates])
    return Plan(B=B, T=T, H=H, Hk=H, K=K, V=V, N=B, initial_state=False, scale=K ** -0.5,
                reverse=False, varlen=False, packed=False, dtype=DTYPES.get(dtype, dtype), **kw)


def _versions():
    import triton

    try:
        import torch

        tv = torch.__version__
    except ImportError:
        tv = None
    return {"triton": triton.__version__, "torch": tv}


def fla_report(shape, dtype="bf16", log=None) -> dict:
    """parity.compiled.fla's report of fla's chunk_gla kernels at `shape` (sm_90), run in
    a subprocess (it stands in an H100 for fla and torch.cuda); {"error": why} when
    fla-core is not installed or the run fails."""
    import importlib.util
    import subprocess
    import tempfile

    if importlib.util.find_spec("fla") is None:
        return {"error": "fla-core not installed (the bench extra: pip install --no-deps "
                         "fla-core==0.6.0)"}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "fla.json")
        env = dict(os.environ, TRITON_INTERPRET="0")
        proc = subprocess.run([sys.executable, "-m", "parity.compiled", "--fla", "--shape",
                               ",".join(map(str, shape)), "--dtype", dtype, "--json", out],
                              env=env, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr.splitlines():
            if log and line.startswith("fla "):
                log(line)
        if proc.returncode != 0 or not os.path.exists(out):
            return {"error": f"parity.compiled --fla failed: {proc.stderr[-1500:]}"}
        with open(out) as f:
            return json.load(f)


def report(shape, dtype="bf16", mode="chunk", archs=(80, 90), gates="key", ptx_dir=None,
           hints=True, log=None, compare_fla=False) -> dict:
    """Compile the forward and backward (use_dht=True) launch lists of one call
    for each arch; the JSON object `--report --json` prints. `compare_fla` adds
    fla's GLA chunk kernels at the same shape ("fla", see `fla_report`)."""
    from bridge.kernels import family

    fam = family(mode)
    plan = report_plan(shape, dtype, gates)
    short = {v: k for k, v in DTYPES.items()}[plan.dtype]
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
    launches, used, lists, counted = [], set(), {}, {}
    for arch in archs:
        with for_arch(arch):  # the launch lists a device of this arch runs
            # the forward and backward as autograd runs them (the backward with the
            # buffers the forward keeps), and the forward no backward follows where it
            # differs ("fwd-infer": fused_chunk writes no A there)
            kept = fam.kept(plan)
            fwd, infer = fam.forward_launches(plan), fam.forward_launches(plan, keep=False)
            phases = [("fwd", fwd), *([("fwd-infer", infer)] if infer != fwd else []),
                      ("bwd", fam.backward_launches(plan, True, kept))]
        lists[arch] = phases
        dtypes = tensor_dtypes(plan, [ls for _, ls in phases])
        trips = {}
        for _, ls in phases:
            for launch in ls:
                # an arch whose launch is another's (most are) reuses its trip counts
                params = launch_params(launch, dtypes)
                key = (launch.kernel.__name__, repr(launch.grid), repr(params))
                if key not in counted:
                    counted[key] = launch_trips(launch.kernel, launch.grid, params)
                trips[id(launch)] = counted[key]
        for phase, ls in phases:
            for launch in ls:
                name = launch.kernel.__name__
                grid = [int(x) for x in launch.grid]
                programs = 1
                for x in grid:
                    programs *= x
                rec = dict(kernel=name, phase=phase, target=f"sm_{arch}", grid=grid,
                           programs=programs, num_warps=launch.num_warps,
                           num_stages=launch.num_stages, n_regs=None, n_spills=None,
                           shared=None, mma=0, wgmma=0, mma_types=[],
                           dot_flops=int(launch.dot_flops), bytes=int(launch.bytes))
                t0 = time.time()
                try:
                    k, use = compile_with_usage(launch, dtypes, arch, hints)
                    ptx = k.asm["ptx"]
                    rec.update(n_regs=use["regs"], n_spills=use["spill_bytes"] or 0,
                               shared=k.metadata.shared, **count_mma(ptx))
                    tc, why = trips[id(launch)]
                    rec.update(sass_fields(k, tc, launch.num_warps, arch, rec["n_regs"],
                                           rec["shared"], why, programs))
                    if ptx_dir:
                        # a kernel launched twice in one phase gets .2, .3, ...
                        stem, i = f"{name}.{phase}", 1
                        while (stem, arch) in used:
                            i += 1
                            stem = f"{name}.{phase}.{i}"
                        used.add((stem, arch))
                        rec["ptx_file"] = f"{stem}.sm_{arch}.{short}.ptx"
                        with open(os.path.join(ptx_dir, rec["ptx_file"]), "w") as f:
                            f.write(ptx)
                except Exception as e:  # report every failure, keep going
                    rec["error"] = f"{type(e).__name__}: {e}"[:500]
                rec["lower_bound_us"], rec["peak_flops"] = lower_bound(rec)
                rec["seconds"] = round(time.time() - t0, 2)
                launches.append(rec)
                if log:
                    log(f"{rec['target']} {phase} {name}: regs={rec['n_regs']} "
                        f"spills={rec['n_spills']} shared={rec['shared']} mma={rec['mma']} "
                        f"wgmma={rec['wgmma']} {rec['mma_types']} "
                        f"ctas/SM={rec.get('ctas_per_sm')} "
                        f"dyn={rec.get('dynamic', 0) / 1e9:.3f}G ({rec['seconds']} s)"
                        + (f" ERROR {rec['error']}" if "error" in rec else ""))
    bound_arch = 90 if 90 in archs else archs[0]
    bound_target = f"sm_{bound_arch}"
    bounds = {p: sum(r["lower_bound_us"] for r in launches
                     if r["phase"] == p and r["target"] == bound_target) for p in ("fwd", "bwd")}
    bounds["total"] = bounds["fwd"] + bounds["bwd"]
    dynamic = {f"sm_{a}": {p: sum(r.get("dynamic", 0) for r in launches
                                  if r["phase"] == p and r["target"] == f"sm_{a}")
                           for p in ("fwd", "bwd")} for a in archs}
    rep = {"shape": dict(B=plan.B, T=plan.T, H=plan.H, Hk=plan.Hk, K=plan.K, V=plan.V,
                         N=plan.N),
           "dtype": short, "mode": mode, "gates": gates, "archs": [f"sm_{a}" for a in archs],
           "alignment_hints": hints, "launches": launches, "kept": list(kept),
           "workspace_bytes": workspace_bytes(plan, dict(lists[bound_arch])["bwd"]),
           "lower_bound_us": bounds, "lower_bound_target": bound_target,
           "dynamic_warp_instructions": dynamic,
           "peaks": {"tensor_core_flops": PEAK_TC_FLOPS, "tf32_flops": PEAK_TF32_FLOPS,
                     "fp32_flops": PEAK_FP32_FLOPS, "hbm_bytes_per_s": PEAK_HBM_BYTES},
           "versions": _versions()}
    if compare_fla:
        rep["fla"] = (fla_report(shape, short, log) if mode == "chunk" and gates == "key" else
                      {"error": "fla's chunk_gla is compared at mode=chunk, gates=key only"})
    if mode == "chunk" and 90 in archs:
        rep["targets"] = targets(rep)
    return rep


def markdown(rep: dict, sass_target=None) -> str:
    """A markdown table of a report, for BENCHMARKS.md; the SASS tables for
    `sass_target` only (e.g. "sm_90"), or for every target."""
    s = rep["shape"]
    lines = [f"`parity.compiled --report` mode={rep['mode']} gates={rep['gates']} "
             f"dtype={rep['dtype']} "
             f"(B,T,H,K,V)=({s['B']},{s['T']},{s['H']},{s['K']},{s['V']}); triton "
             f"{rep['versions']['triton']}. Lower bound: H100 SXM roofline "
             f"({rep['lower_bound_target']} PTX), workspace "
             f"{rep['workspace_bytes'] / 2**20:.1f} MiB"
             + (f"; the backward reuses the forward's {', '.join(rep['kept'])} "
                "(the family's `kept`; phase fwd the forward that writes it, fwd-infer the "
                "forward no backward follows)." if rep.get("kept") else "."), "",
             "| phase | kernel | target | grid | warps/stages | regs | spill B | smem KiB "
             "| mma | wgmma | types | GFLOP | MB | bound us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["launches"]:
        shared = "-" if r["shared"] is None else f"{r['shared'] / 1024:.1f}"
        lines.append(f"| {r['phase']} | `{r['kernel']}` | {r['target']} | "
                     f"{'x'.join(map(str, r['grid']))} | {r['num_warps']}/{r['num_stages']} | "
                     f"{r['n_regs']} | {r['n_spills']} | {shared} | {r['mma']} | {r['wgmma']} | "
                     f"{','.join(r['mma_types']) or '-'} | {r['dot_flops'] / 1e9:.2f} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['lower_bound_us']:.1f} |")
    b = rep["lower_bound_us"]
    lines += ["", f"Lower bound (us): fwd {b['fwd']:.1f}, bwd {b['bwd']:.1f}, "
                  f"total {b['total']:.1f}.", "",
              sass_markdown([r for r in rep["launches"]
                             if sass_target in (None, r["target"])])]
    dyn = rep.get("dynamic_warp_instructions") or {}
    lines += ["", "Dynamic warp-instructions (estimate): " + "; ".join(
        f"{t} fwd {d['fwd'] / 1e9:.3f}G, bwd {d['bwd'] / 1e9:.3f}G" for t, d in dyn.items()) + "."]
    fla = rep.get("fla")
    if fla and fla.get("launches"):
        d = fla["dynamic"]
        lines += ["", f"flash-linear-attention {fla['versions']['fla']} `chunk_gla` (forward with "
                      "final state, backward with its gradient), compiled the same way for sm_90 "
                      "(`parity.compiled.fla`) at every autotune config fla offers on an H100; per "
                      "kernel the config [in brackets] with the fewest dynamic warp-instructions.",
                  "", sass_markdown(fla["launches"]), "",
                  f"fla dynamic warp-instructions: fwd {d['fwd'] / 1e9:.3f}G, "
                  f"bwd {d['bwd'] / 1e9:.3f}G."]
    elif fla:
        lines += ["", f"fla: {fla.get('error')}"]
    from . import timemodel

    lines += ["", timemodel.TEXT, "", timemodel.launch_markdown(rep["launches"])]
    if fla and fla.get("launches"):
        lines += ["", "fla (its autotuner's pick: the fastest config by the model):", "",
                  timemodel.launch_markdown(fla["launches"])]
    if rep.get("targets"):
        lines += ["", targets_markdown(rep["targets"])]
    return "\n".join(lines)


SASS_TEXT = ("SASS: Triton's bundled nvdisasm on the cubin. CTAs/SM from registers "
             "(allocated per warp in units of 256), shared memory (+1 KiB reserved per CTA) and "
             "warps against the per-SM limits of sm_90 (H100: 64K registers, 228 KiB, 64 warps, "
             "32 CTAs) and sm_80 (A100: 64K, 164 KiB, 64, 32). Loops are found from backward "
             "branches and named by the source line of the closing branch; a loop's runs are its "
             "source loop's body executions summed over the grid, from running the kernel's "
             "control flow (parity/compiled/tripcounts.py) with the launch's constexprs, "
             "scalars and "
             "every program id, divided by ptxas's unroll factor. Dynamic = sum over code regions "
             "of instructions x runs, x warps (code outside loops once per program; predicated "
             "and branched-around code counted: an upper bound). Class counts per loop are static, "
             "nested loops included; BAR = bar.sync, LDGSTS = cp.async, UTMALDG = TMA.")


def _cls(c: dict) -> str:
    from .sass import REPORTED

    return " | ".join(str(c.get(k, 0)) for k in REPORTED)


def sass_markdown(recs) -> str:
    """The SASS tables of report records: one row per launch, one per loop."""
    from .sass import REPORTED

    head = " | ".join(REPORTED)
    lines = [SASS_TEXT, "",
             "| phase | kernel | target | warps | regs | smem KiB | CTAs/SM (limit) | SASS instr | "
             "loops | max BAR in a loop | dyn warp-instr G | dyn " + " | dyn ".join(REPORTED)
             + " (M) |", "|---" * (12 + len(REPORTED)) + "|"]
    loops = ["", "| phase | kernel | target | loop (line) | depth | body instr (own / nested) | "
             + head + " | runs per program | trip count |", "|---" * (8 + len(REPORTED)) + "|"]
    for r in recs:
        if "loops" not in r:
            continue
        occ = r["occupancy"]
        shared = "-" if r["shared"] is None else f"{r['shared'] / 1024:.1f}"
        name = f"`{r['kernel']}`" + (f" [{r['config']}]" if r.get("config") else "")
        lines.append(f"| {r['phase']} | {name} | {r['target']} | {r['num_warps']} | "
                     f"{r['n_regs']} | {shared} | {r['ctas_per_sm']} ({occ['limiter']}) | "
                     f"{r['sass_instructions']} | {len(r['loops'])} | {max_loop_bars(r)} | "
                     f"{r['dynamic'] / 1e9:.3f} | "
                     + " | ".join(f"{r['dynamic_classes'][c] / 1e6:.1f}" for c in REPORTED) + " |")
        for lp in r["loops"]:
            loops.append(f"| {r['phase']} | `{r['kernel']}` | {r['target']} | {lp['line']} | "
                         f"{lp['depth']} | {lp['static']} / {lp['static_nested']} | "
                         f"{_cls(lp['classes_nested'])} | {lp['runs_per_program']:g} | "
                         f"{lp['trips']} |")
        for note in r.get("sass_notes") or ():
            loops.append(f"| {r['phase']} | `{r['kernel']}` | {r['target']} | note | | | "
                         + " | " * (len(REPORTED) - 1) + f" | | {note} |")
    return "\n".join(lines + loops)
