"""Step "kernels": per-kernel device times. One forward+backward of ours (each Triton family, torch
launch) and of fla's chunk_gla at (B, profile_T, H, K, V), bf16, key gate, warmed, then
profiled (`torch.profiler`, CUDA activity only; forward and backward in two sessions):
each kernel's name, grid and device time. Beside each of our kernels, the instruction
model's prediction from the committed AOT report (BENCHMARKS.md "GPU readiness":
dynamic warp-instructions, registers, CTAs per SM, the most bar.sync in a loop body),
on an H100 or H200 the time model's microseconds (parity/compiled/timemodel.py) and its
error against the device time, per kernel and in sum, how well the model ranks our
kernels (Spearman's rank correlation of predicted instructions and measured time), and
the stages (state, intra, output; dA, dv, dq/dk) ours against fla's. The dry run's
stand-in: each of our launches timed alone by a host clock in the interpreter, beside
the H200's time model; fla's stand-ins launch no kernels of fla's.
"""

import json
import os
import re
import tempfile

import numpy as np

from parity.bench import gpu

from . import fla as fla_mod
from .plan import FAMILIES
from .rows import failure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READINESS = os.path.join(ROOT, "parity", "bench", "results", "results.json")
FLA = "fla chunk_gla"
# (stage, pattern on the kernel's name), the first that matches; ours and fla's names
STAGES = {
    "fwd": [("gates", r"gate|cumsum"), ("state", r"state|kernel_h\b|_h$"),
            ("intra", r"intra|_A_"), ("output", r"output|kernel_o\b|_o$"),
            ("recurrence", r"fused_recurrent")],
    "bwd": [("gates", r"gate|cumsum"), ("state", r"state|_dh$|_h$"),
            ("intra", r"^chunk_intra_kernel$"), ("output", r"output"), ("dA", r"dA"),
            ("dv", r"dv"), ("dq/dk", r"dqk|dq|dk|inter|intra"),
            ("recurrence", r"fused_recurrent")],
}


def stage(phase, name) -> str:
    return next((s for s, pat in STAGES[phase] if re.search(pat, name)), "other")


def names(plan) -> list:
    """[(implementation, family)] this step profiles: ours in every Triton family."""
    fla = ("stand-in for " if plan.dry else "") + FLA
    return [(f"ours {f} (torch)", f) for f in FAMILIES] + [(fla, "chunk")]


def expected(plan) -> list:
    return [dict(impl=n) for n, _ in names(plan)]


def fla_calls(plan):
    """fla's call here, for the tune step (none when the speed step's calls cover it)."""
    fns, _ = fla_mod.ops(plan)
    if fns is None or plan.profile_T in plan.Ts:
        return []
    return [(f"kernels chunk_gla T={plan.profile_T}",
             lambda: _fwd_bwd(_op(fns, "chunk", plan), plan, 1))]


def _op(fns, family, plan):
    if fns is None:
        import torch_side

        return lambda q, k, v, g: torch_side.recurrent_gla(q, k, v, g, platform="triton",
                                                           mode=family)[0]
    return lambda q, k, v, g: fns["chunk_gla"](q, k, v, g, output_final_state=True)[0]


def _fwd_bwd(op, plan, repeat):
    q, k, v, g, do = [x.requires_grad_(i < 4) for i, x in enumerate(
        gpu.gla_inputs((plan.B, plan.profile_T, plan.H, plan.K, plan.V), plan.device))]
    for _ in range(repeat):
        torch_grad(op(q, k, v, g), (q, k, v, g), do)
    return q, k, v, g, do


def torch_grad(out, leaves, do):
    import torch

    return torch.autograd.grad(out, leaves, do)


def _trace_kernels(prof) -> list:
    """[(name, grid, microseconds)] of the kernels in a profiler session's trace."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return [(e["name"], (e.get("args") or {}).get("grid"), float(e.get("dur", 0.0)))
            for e in events if e.get("cat") == "kernel"]


def profile(op, plan) -> list:
    """[{phase, kernel, grid, us}] of one warmed forward+backward of `op` on CUDA."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    q, k, v, g, do = _fwd_bwd(op, plan, 2)
    torch.cuda.synchronize()
    rows, out = [], []
    for phase in ("fwd", "bwd"):
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            if phase == "fwd":
                out.append(op(q, k, v, g))
            else:
                torch_grad(out[0], (q, k, v, g), do)
            torch.cuda.synchronize()
        rows += [dict(phase=phase, kernel=n, grid=grid, us=us)
                 for n, grid, us in _trace_kernels(prof)]
    return rows


def host_timed(family, plan) -> list:
    """The dry run's stand-in for `profile`: each of our launches timed alone."""
    size = (plan.B, plan.profile_T, plan.H, plan.K, plan.V)
    return [dict(phase=r["stage"], kernel=r["kernel"], grid=r["grid"], us=r["ms"] * 1e3)
            for r in gpu.launch_times(family, size, 1.0, 1.0, plan.device, rep_ms=1)]


def model(mode, target, path=READINESS, gpu=None) -> dict:
    """{(phase, kernel, occurrence): prediction} from the committed AOT report of `mode`
    (key gate) for `target` ("sm_90"): dynamic warp-instructions, registers, CTAs per
    SM, the most bar.sync in a loop body, and with `gpu` (parity.compiled.timemodel's
    HARDWARE entry) the time model's microseconds for an sm_90 launch ("model_us")."""
    from parity.compiled import timemodel
    from parity.compiled.report import max_loop_bars

    try:
        with open(path) as f:
            reports = json.load(f)["readiness"]["gpu"]
    except (OSError, KeyError, ValueError):
        return {}
    rep = next((r for r in reports if r.get("mode") == mode and r.get("gates") == "key"), None)
    out, seen = {}, {}
    for r in (rep or {}).get("launches", ()):
        if r["target"] != target or "loops" not in r:
            continue
        n = seen[(r["phase"], r["kernel"])] = seen.get((r["phase"], r["kernel"]), 0) + 1
        out[(r["phase"], r["kernel"], n)] = dict(
            model_dynamic=r.get("dynamic"), model_regs=r.get("n_regs"),
            model_ctas_per_sm=r.get("ctas_per_sm"), model_bars=max_loop_bars(r),
            model_config=[r.get("num_warps"), r.get("num_stages")],
            **({"model_us": timemodel.launch_time(r, gpu)["total"] * 1e6}
               if gpu is not None and timemodel.modelled([r]) else {}))
    return out


def modelled_gpu(name: str):
    """The time model's HARDWARE entry for a device name ("NVIDIA H200" -> H200), or None."""
    from parity.compiled import timemodel

    return next((g for key, g in timemodel.HARDWARE.items() if key in name), None)


def launch_configs(plan, mode) -> dict:
    """{(phase, kernel, occurrence): [num_warps, num_stages]} of our launches at the
    profiled call, as this device runs them (its tuning table's entries included)."""
    from parity.compiled import report
    from bridge.kernels import family

    fam = family(mode)
    p = report.report_plan((plan.B, plan.profile_T, plan.H, plan.K, plan.V),
                        "fp32" if plan.dry else "bf16", "key")
    out, seen = {}, {}
    for phase, ls in (("fwd", fam.forward_launches(p)),
                      ("bwd", fam.backward_launches(p, True, fam.kept(p)))):
        for launch in ls:
            name = launch.kernel.__name__
            n = seen[(phase, name)] = seen.get((phase, name), 0) + 1
            out[(phase, name, n)] = [launch.num_warps, launch.num_stages]
    return out


def spearman(xs, ys):
    """Spearman's rank correlation (ties averaged), or None under 3 pairs."""
    if len(xs) < 3:
        return None

    def ranks(a):
        a = np.asarray(a, float)
        order = a.argsort()
        r = np.empty(len(a))
        r[order] = np.arange(len(a))
        for v in np.unique(a):
            r[a == v] = r[a == v].mean()
        return r
    rx, ry = ranks(xs), ranks(ys)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def annotate(rows, mode, target, ran=None, gpu=None) -> list:
    """Our kernel rows with their stage and the model's prediction (matched by phase,
    kernel and occurrence); with `ran` (`launch_configs`), each row's [num_warps, num_stages]
    as "config", which the model's "model_config" may not be (a tuned launch); with `gpu`,
    the time model's microseconds (`model`)."""
    pred, seen, out = model(mode, target, gpu=gpu), {}, []
    for r in rows:
        key = (r["phase"], r["kernel"])
        n = seen[key] = seen.get(key, 0) + 1
        out.append(dict(r, stage=stage(*key), **pred.get((*key, n), {}),
                        **({"config": ran[(*key, n)]} if ran and (*key, n) in ran else {})))
    return out


def summary(rows) -> dict:
    """{"rank_correlation": {impl: rho}, "stages": {impl: {"fwd/state": us, ...}},
    "model_error": {impl: (sum of the time model's us - sum of device us) / device us over
    the kernels the model has}}."""
    rho, stages, err = {}, {}, {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        pairs = [(r["model_dynamic"], r["us"]) for r in mine if r.get("model_dynamic")]
        if impl.startswith("ours"):
            rho[impl] = spearman([p[0] for p in pairs], [p[1] for p in pairs])
        timed = [(r["model_us"], r["us"]) for r in mine if r.get("model_us") and r["us"]]
        if timed:
            err[impl] = sum(m for m, _ in timed) / sum(u for _, u in timed) - 1
        st = {}
        for r in mine:
            key = f"{r['phase']}/{r['stage']}"
            st[key] = st.get(key, 0.0) + r["us"]
        stages[impl] = st
    return {"rank_correlation": rho, "stages": stages, "model_error": err}


def run(emit, deadline, *, plan, configs=None):
    """Each implementation profiled, guarded; the summary as the result (module doc)."""
    import time

    fns, why, _ = fla_mod.prepare(plan, configs)
    target, hw = "sm_90", "H200"  # the dry run's stand-in: the H200's time model
    if not plan.dry:
        import torch

        target = "sm_90" if torch.cuda.get_device_capability()[0] >= 9 else "sm_80"
        hw = torch.cuda.get_device_name()
    gpu_model = modelled_gpu(hw)
    rows = []
    for impl, family in names(plan):
        if time.monotonic() > deadline:
            emit("profile", impl=impl, status="not_reached",
                 error="not reached before the step's cap")
            continue
        ours = impl.startswith("ours")
        if not ours and (fns is None or plan.dry):
            emit("profile", impl=impl, status="absent",
                 error=why or "stand-in: fla's stand-ins launch no kernels of fla's")
            continue
        try:
            got = (host_timed(family, plan) if plan.dry else
                   profile(_op(None if ours else fns, family, plan), plan))
            got = annotate(got, family, target, launch_configs(plan, family),
                           gpu_model) if ours else [
                dict(r, stage=stage(r["phase"], r["kernel"])) for r in got]
        except Exception as e:
            emit("profile", impl=impl, **failure(e))
            continue
        for r in got:
            r.update(impl=impl, family=family)
            emit("kernel", **r)
        rows += got
        emit("profile", impl=impl, status="ok", error=None, kernels=len(got),
             total_us=sum(r["us"] for r in got))
    return dict(summary(rows), target=target, T=plan.profile_T,
                time_model=gpu_model.name if gpu_model else None,
                model_source="the committed AOT report (parity/bench/results/results.json, "
                             "readiness) at (8,4096,16,128,128) bf16, key gate")
