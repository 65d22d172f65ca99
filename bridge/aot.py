"""Ahead-of-time compile of the Triton kernels, with no GPU.

    TRITON_INTERPRET=0 python -m bridge.aot --arch 90 [--family all] [--json PATH]

builds every launch of `VARIANTS` (through the same launch lists the
frameworks run) to cubin for the given CUDA arch, and prints one line per
kernel variant with its shared memory, registers and spills. Exits 1 if any
variant fails to build or needs more shared memory than the arch has.
`--hints` compiles them with a real launch's alignment hints (off by default:
the known spills in tests/test_triton_*.py were measured without them).

    TRITON_INTERPRET=0 python -m bridge.aot --report [--shape B,T,H,K,V] [--dtype bf16]
        [--mode chunk] [--gates key] [--arch 80,90] [--json [PATH]] [--markdown]
        [--ptx-dir DIR]

compiles the forward and backward launch lists of one call for each arch and
reports, per launch: grid, warps/stages, registers, spills, shared memory,
tensor-core instructions in the PTX (mma.sync / wgmma.mma_async and their
operand types), the launch's dot FLOPs and HBM bytes, and a roofline lower
bound on an H100 SXM; plus the backward's workspace (see `report`). Its SASS
section (bridge/sass.py, trip counts from bridge/tripcounts.py) adds per launch
CTAs per SM, static instructions, every loop with its bar.sync / SHFL /
MUFU.EX2 / cp.async / TMA / MMA counts, and a dynamic warp-instruction estimate;
for mode chunk on sm_90, issue 30's targets met / NOT met (`targets`); and the time
model's table per launch on an H200 and an H100 (bridge/timemodel.py).
"""

import argparse
import json
import os
import re
import sys
import time

from . import dispatch, tuning
from .contract import ARGS, nbytes
from .launch import resolve_dtype

SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_TL = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# H100 SXM peaks (dense): the roofline of `lower_bound`.
PEAK_TC_FLOPS = 989e12     # bf16 / fp16 tensor cores
PEAK_TF32_FLOPS = 494.7e12  # tf32 tensor cores
PEAK_FP32_FLOPS = 67e12     # fp32 FMA units: dots without mma/wgmma (ieee fp32)
PEAK_HBM_BYTES = 3.35e12    # HBM3


def _variants():
    """(label, plan, input dtypes) covering every flag value, dtype and block size."""
    from .contract import Plan

    def plan(K=64, V=64, H=2, Hk=1, g="none", gk=False, gv=False, g_gamma="none", h0=False,
             reverse=False, varlen=False, dtype="float32"):
        return Plan(B=1, T=64, H=H, Hk=Hk, K=K, V=V, N=2 if varlen else 1, g=g, gk=gk, gv=gv,
                    g_gamma=g_gamma, initial_state=h0, scale=K ** -0.5, reverse=reverse,
                    varlen=varlen, packed=False, dtype=dtype)

    out = [("plain", plan()),
           ("g-head", plan(g="head")), ("g-key", plan(g="key")), ("gk", plan(gk=True)),
           ("gv", plan(gv=True)), ("gamma-head", plan(g_gamma="head")),
           ("gamma-seq+varlen", plan(g_gamma="seq", varlen=True)),
           ("h0+reverse", plan(h0=True, reverse=True)), ("gqa", plan(H=4, Hk=2))]
    everything = dict(g="key", gk=True, gv=True, g_gamma="seq", h0=True, reverse=True,
                      varlen=True, H=4, Hk=2)
    for dtype in ("float32", "float16", "bfloat16"):
        out.append((f"all-{dtype}", plan(dtype=dtype, **everything)))
    for K, V in ((16, 16), (32, 48), (100, 100), (128, 128), (256, 256), (256, 64)):
        out.append((f"K{K}-V{V}", plan(K=K, V=V, g="head", gv=True, h0=True)))
    # the widest heads (dispatch.HEAD_DIMS; families that refuse them are skipped)
    out += [("K512-V512-key-bf16", plan(K=512, V=512, g="key", dtype="bfloat16")),
            ("K512-V512-all-bf16", plan(K=512, V=512, dtype="bfloat16", **everything))]
    return out


# ---------------------------------------------------------------- tensor dtypes

def input_dtypes(plan, gamma_like_q: bool = False) -> dict:
    """dtype of every tensor a caller hands in (`Plan.tensor_dtype`). The variant
    mode keeps its historical g_gamma in q's dtype (`gamma_like_q`)."""
    d = {n: plan.tensor_dtype(n) for n in (*ARGS, "do", "dfinal_state")}
    if gamma_like_q:
        d["g_gamma"] = plan.dtype
    return d


def tensor_dtypes(plan, launch_lists, gamma_like_q: bool = False) -> dict:
    """{name: dtype} for the inputs and for every Out of the launch lists, in
    order (forward then backward), so a buffer an earlier launch wrote (e.g. a
    forward state reused by the backward) has that Out's dtype."""
    env = input_dtypes(plan, gamma_like_q)
    for launches in launch_lists:
        for launch in launches:
            for o in launch.writes():
                env[o.name] = resolve_dtype(o.dtype, env.__getitem__)
    return env


def workspace_bytes(plan, launches) -> int:
    """Device memory a backward launch list allocates beyond the gradients it
    returns: the bytes of every Out buffer minus the bytes of the gradients of
    the inputs present in `plan` (`Plan.gradients`)."""
    total = sum(o.nbytes(plan) for launch in launches for o in launch.writes())
    return total - sum(nbytes(s, d) for s, d in plan.gradients().values())


# ---------------------------------------------------------------- compiling

def _tensor_name(kind, value) -> str:
    """The tensor a launch's tensor argument points at: an input's name, an Out's name,
    or for an absent one q (the launchers pass q's pointer there)."""
    if value is None:
        return "q"
    return value.name if kind == "out" else value


def build_source(launch, dtypes: dict, hints: bool = True, floats: str = "fp32"):
    """Triton's ASTSource for `launch`, specialised as a real launch is: pointers
    (absent ones get q, as the launchers pass it) 16-byte aligned and integer
    scalars divisible by 16 where they are (`tt.divisibility` 16), an int of 1
    a constant; floats never specialised, typed `floats` ("fp32" as Triton's own
    launcher types a Python float, "fp64" as Inductor types a user kernel's under
    torch.compile on CUDA). `hints=False` drops the alignment."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn = launch.kernel
    sig, constexprs, attrs = {}, dict(launch.constexprs), {}
    for p in fn.arg_names:
        if p in constexprs:
            sig[p] = "constexpr"
    for p, kind, a in launch.arguments():
        if kind != "scalar":
            # torch allocations are 256-byte aligned: every pointer gets "D"
            ty, spec = "*" + _TL[dtypes[_tensor_name(kind, a)]], "D"
        else:
            # the same call JITFunction's binder makes for a scalar argument
            ty, spec = native_specialize_impl(CUDABackend, a, False, True, True)
            ty = floats if ty == "fp32" else ty
        if ty == "constexpr":
            sig[p], constexprs[p] = "constexpr", spec
            continue
        sig[p] = ty
        if hints and spec:
            attrs[(fn.arg_names.index(p),)] = CUDABackend.parse_attr(spec)
    return ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)


def _compile(launch, dtypes, arch, hints=True, floats="fp32"):
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compile(build_source(launch, dtypes, hints, floats),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": launch.num_warps,
                                   "num_stages": launch.num_stages})


class _Float32Default(dict):
    """Variant mode's dtypes: a buffer no Out of the launch names is float32."""

    def __missing__(self, key):
        return "float32"


def compile_launch(launch, plan, arch, hints=True, dtypes=None):
    """Build one launch of `plan` for `arch`: shared memory, registers, spills.
    Without `dtypes`, as the variant mode always did: g_gamma in q's dtype and
    a buffer of an earlier launch float32 (pass `tensor_dtypes` to resolve it)."""
    if dtypes is None:
        dtypes = _Float32Default(tensor_dtypes(plan, [[launch]], gamma_like_q=True))
    k = _compile(launch, dtypes, arch, hints)
    return dict(shared=k.metadata.shared, **_ptxas_usage(k.asm["ptx"], arch))


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes, from Triton's bundled ptxas (-v), since the
    compiled kernel reports them only once loaded onto a GPU."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch_name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={arch_name}", path,
                              "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    return _parse_ptxas_log(res.stdout + res.stderr)


def _parse_ptxas_log(log: str) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_bytes=sum(int(x) for x in spills) if spills else None)


def _compile_with_usage(launch, dtypes, arch, hints=True):
    """(compiled kernel, registers and spills) from the ptxas -v run Triton
    itself makes for the cubin (its flags, no second ptxas run); a kernel
    found in Triton's cache has no log, so ptxas runs again on its PTX."""
    import contextlib
    import io

    from triton import knobs

    buf = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(buf):
        knobs.nvidia.dump_ptxas_log = True
        k = _compile(launch, dtypes, arch, hints)
    use = _parse_ptxas_log(buf.getvalue())
    if use["regs"] is None:
        use = _ptxas_usage(k.asm["ptx"], arch)
    return k, use


# ---------------------------------------------------------------- reading PTX

_MMA = re.compile(r"^\s*(?:@!?%\w+\s+)?mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col"
                  r"\.\w+\.(\w+)\.(\w+)\.\w+", re.M)
_WGMMA = re.compile(r"^\s*(?:@!?%\w+\s+)?wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+"
                    r"\.\w+\.(\w+)\.(\w+)", re.M)


def count_mma(ptx: str) -> dict:
    """Tensor-core instructions in PTX: mma.sync (sm_80 style) and
    wgmma.mma_async (sm_90) counts and their distinct A/B operand types."""
    mma, wgmma = _MMA.findall(ptx), _WGMMA.findall(ptx)
    types = sorted({t for pair in mma + wgmma for t in pair})
    return dict(mma=len(mma), wgmma=len(wgmma), mma_types=types)


def lower_bound(rec: dict) -> tuple:
    """(microseconds, peak FLOP/s used) of a launch record on an H100 SXM:
    max(dot_flops / peak, bytes / HBM peak). The peak is the tensor cores'
    when the PTX has mma/wgmma (tf32's when tf32 is the only operand type),
    else the fp32 FMA units'."""
    if rec.get("mma") or rec.get("wgmma"):
        types = set(rec.get("mma_types") or ())
        peak = PEAK_TF32_FLOPS if types == {"tf32"} else PEAK_TC_FLOPS
    else:
        peak = PEAK_FP32_FLOPS
    us = max(rec.get("dot_flops", 0) / peak, rec.get("bytes", 0) / PEAK_HBM_BYTES) * 1e6
    return us, peak


# ---------------------------------------------------------------- SASS

def launch_params(launch, dtypes: dict = None) -> dict:
    """{parameter: value} of a launch for `bridge.tripcounts`: constexprs and
    scalars as given, tensors pointers of their dtype in `dtypes` ({name: dtype
    name}, as `tensor_dtypes` gives; absent ones get q's, as the launchers pass
    q), or UNKNOWN without `dtypes`."""
    from .tripcounts import UNKNOWN, pointer

    params = dict(launch.constexprs)
    for p, kind, a in launch.arguments():
        if kind == "scalar":
            params[p] = a
        else:
            params[p] = pointer(dtypes[_tensor_name(kind, a)]) if dtypes else UNKNOWN
    return params


def launch_trips(kernel, grid, params):
    """(TripCounts, None) of one launch, or (None, the reason it failed)."""
    from .tripcounts import trip_counts

    try:
        return trip_counts(kernel, grid, params), None
    except Exception as e:  # the report says so and counts each loop once per program
        return None, f"trip counts not derived: {type(e).__name__}: {e}"[:300]


def sass_fields(compiled, trips, num_warps, arch, regs, shared, trips_error=None,
                programs=1) -> dict:
    """The SASS columns of one compiled launch: CTAs per SM (and what limits
    them), static instructions, loops, dynamic warp-instruction estimate."""
    from . import sass

    occ = sass.occupancy(regs, shared, num_warps, arch)
    a = sass.analyze(compiled.asm["cubin"], compiled.asm.get("ptx", ""), trips, num_warps,
                     programs=programs)
    notes = list(a.notes) + ([trips_error] if trips_error else [])
    return dict(ctas_per_sm=occ["ctas"], occupancy=occ, sass_instructions=a.instructions,
                loops=a.loops, dynamic=a.dynamic, dynamic_classes=a.dynamic_classes,
                sass_notes=notes, mma_flops=a.mma_flops, chain=a.chain)


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
         "gamma": dict(g_gamma="head"),
         "all": dict(g="key", gk=True, gv=True, g_gamma="head")}


def report_plan(shape, dtype="bf16", gates="key"):
    """The Plan of one call at `shape` (B, T, H, K, V), Hk = H, N = B."""
    from .contract import Plan

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
    """bridge.aot_fla's report of fla's chunk_gla kernels at `shape` (sm_90), run in
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
        proc = subprocess.run([sys.executable, "-m", "bridge.aot_fla", "--shape",
                               ",".join(map(str, shape)), "--dtype", dtype, "--json", out],
                              env=env, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr.splitlines():
            if log and line.startswith("fla "):
                log(line)
        if proc.returncode != 0 or not os.path.exists(out):
            return {"error": f"bridge.aot_fla failed: {proc.stderr[-1500:]}"}
        with open(out) as f:
            return json.load(f)


def report(shape, dtype="bf16", mode="chunk", archs=(80, 90), gates="key", ptx_dir=None,
           hints=True, log=None, compare_fla=False) -> dict:
    """Compile the forward and backward (use_dht=True) launch lists of one call
    for each arch; the JSON object `--report --json` prints. `compare_fla` adds
    fla's GLA chunk kernels at the same shape ("fla", see `fla_report`)."""
    from .kernels import family

    fam = family(mode)
    plan = report_plan(shape, dtype, gates)
    short = {v: k for k, v in DTYPES.items()}[plan.dtype]
    # the backward as the default plan runs it: with the forward's buffers it reuses
    kept = fam.kept(plan)
    phases = [("fwd", fam.forward_launches(plan)), ("bwd", fam.backward_launches(plan, True, kept))]
    dtypes = tensor_dtypes(plan, [ls for _, ls in phases])
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
    launches, used = [], set()
    trips = {id(launch): launch_trips(launch.kernel, launch.grid,
                                      launch_params(launch, dtypes))
             for _, ls in phases for launch in ls}
    for arch in archs:
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
                    k, use = _compile_with_usage(launch, dtypes, arch, hints)
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
    bound_target = "sm_90" if 90 in archs else f"sm_{archs[0]}"
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
           "workspace_bytes": workspace_bytes(plan, phases[1][1]),
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
    lines = [f"`bridge.aot --report` mode={rep['mode']} gates={rep['gates']} dtype={rep['dtype']} "
             f"(B,T,H,K,V)=({s['B']},{s['T']},{s['H']},{s['K']},{s['V']}); triton "
             f"{rep['versions']['triton']}. Lower bound: H100 SXM roofline "
             f"({rep['lower_bound_target']} PTX), workspace "
             f"{rep['workspace_bytes'] / 2**20:.1f} MiB"
             + (f"; the backward reuses the forward's {', '.join(rep['kept'])} "
                "(bridge.kernels.chunk.kept)." if rep.get("kept") else "."), "",
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
                      "(`bridge.aot_fla`) at every autotune config fla offers on an H100; per "
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
             "control flow (bridge/tripcounts.py) with the launch's constexprs, scalars and "
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


# ---------------------------------------------------------------- command line

def _stages(families, plan):
    """(stage, launches, dtypes) of each family's forward and backward lists for
    `plan` (and fused_chunk's split forward, "fwd-split"); a buffer the forward writes
    keeps its dtype in the backward."""
    for fam in families:
        if dispatch.refusal(plan, fam.__name__.rsplit(".", 1)[1]) is not None:
            continue
        fwd = fam.forward_launches(plan)
        with tuning.overriding({("fused_chunk", "split"): dict(segments=2)}):
            split = fam.forward_launches(plan)  # fused_chunk's split forward
        lists = [("fwd", fwd), *([("fwd-split", split)] if split != fwd else []),
                 ("bwd", fam.backward_launches(plan, use_dht=True)),
                 ("bwd-nodht", fam.backward_launches(plan, False))]
        dtypes = _Float32Default(tensor_dtypes(plan, [ls for _, ls in lists], gamma_like_q=True))
        for stage, launches in lists:
            yield stage, launches, dtypes


def _ints(text):
    return [int(x) for x in str(text).replace("sm_", "").split(",") if x]


def _variant_mode(args, arch):
    from .kernels import chunk, fused_chunk, fused_recurrent

    families = {"fused_recurrent": [fused_recurrent], "chunk": [chunk],
                "fused_chunk": [fused_chunk],
                "all": [fused_recurrent, chunk, fused_chunk]}[args.family]
    rows, failed, built = [], 0, set()
    for label, plan in _variants():
        for stage, launches, dtypes in _stages(families, plan):
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
                         "all: g, gk, gv and g_gamma")
    ap.add_argument("--ptx-dir", help="write <kernel>.<phase>.sm_<arch>.<dtype>.ptx here")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--compare-fla", action="store_true",
                    help="also compile fla 0.6.0's chunk_gla kernels for sm_90 (fla-core, the "
                         "bench extra) at each autotune config; report the cheapest per kernel "
                         "and the targets against them (minutes on a cold Triton cache)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("bridge.aot: run with TRITON_INTERPRET=0 (the interpreter has no compiler)")
    os.environ.setdefault("TRITON_INTERPRET", "0")
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
