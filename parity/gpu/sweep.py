"""Step "sweep": the config sweep. For each Triton family and gate set of the plan, at
(B, sweep_T, H, K, V) bf16 (the dry run: fp32), every candidate of
`bridge.tuning.candidates` (each launch site's warps, stages and tiles that fit;
compiled ahead by parity/gpu/ahead.py) runs its call's forward and backward once, then
each launch the site's knobs change is timed alone (`parity.bench.gpu.bench`, warm, on
the buffers that call left). A site's winner is its fastest candidate when it beats the
family's defaults by more than MARGIN; the winners go to OUT/tuning.json, a device table
for `python -m bridge.tuning --merge` (bridge/tuning.py: what the launch lists read as
their defaults on this device). Candidates that spill registers are kept: the timing
decides.

A new family is swept once it names its `SITES` and asks `tuning.pick` for them.
fused_chunk's "split" site changes how many launches its forward has: the whole forward
list is timed there, each candidate's own.
"""

import time

from bridge import tuning
from parity.compiled import report

from .rows import failure

MARGIN = 0.03  # a winner must beat the defaults by 3%: less is within the timing noise
DRY_DEVICE = "CPU stand-in (dry run: never shipped)"  # the dry run's table is the CPU's
_ENVS = {}     # (gates, mode) -> the call's inputs: the last call's, per process


def call_plan(plan, gates):
    """The swept call: bf16 (fp32 in the dry run, whose inputs are fp32), this gate set."""
    return report.report_plan((plan.B, plan.sweep_T, plan.H, plan.K, plan.V),
                           "fp32" if plan.dry else "bf16", gates)


def inputs(p, device) -> dict:
    """The call's inputs for `p` (a bridge Plan): activations and log gates, bf16 on CUDA,
    float32 on the CPU, and both cotangents."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    gate = lambda *s: (torch.nn.functional.logsigmoid(mk(*s)) / 16).to(dtype)  # noqa: E731
    B, T, H, K, V, N = p.B, p.T, p.H, p.K, p.V, p.N
    env = dict(q=mk(B, T, H, K).to(dtype), k=mk(B, T, H, K).to(dtype),
               v=mk(B, T, H, V).to(dtype), initial_state=None, cu_seqlens=None,
               g={"key": lambda: gate(B, T, H, K), "head": lambda: gate(B, T, H),
                  "none": lambda: None}[p.g](),
               gk=gate(B, T, H, K) if p.gk else None, gv=gate(B, T, H, V) if p.gv else None,
               g_gamma=-torch.rand(H, device=device) / 16 if p.g_gamma != "none" else None,
               do=mk(B, T, H, V).to(dtype), dfinal_state=mk(N, H, K, V))
    return env


def _lists(p, mode, override=None):
    from bridge.kernels import family

    fam = family(mode)
    with tuning.overriding(override or {}):
        return fam.forward_launches(p), fam.backward_launches(p, True, fam.kept(p))


def affected(p, mode, site, cands) -> list:
    """(phase, index) of each launch that any of the site's candidates changes; (phase,
    -1), the whole phase, where a candidate changes the number of launches (fused_chunk's
    split)."""
    base = _lists(p, mode)
    out = set()
    for fam, s, knobs in cands:
        lists = _lists(p, mode, {(fam, s): knobs})
        for phase, (a, b) in enumerate(zip(base, lists)):
            if len(a) != len(b):
                out.add((phase, -1))
            out |= {(phase, i) for i, (x, y) in enumerate(zip(a, b)) if x != y}
    whole = {phase for phase, i in out if i < 0}
    return sorted((phase, i) for phase, i in out if i < 0 or phase not in whole)


def by_site(plan):
    """[(gates, mode, bridge Plan, (family, site), [candidates])] of the sweep; a candidate
    whose launch lists equal an earlier one's of its site (knobs that change nothing at
    this call: a V block past V, fused_chunk's with_dk without all of V) is left out."""
    out = []
    for gates in plan.sweep_gates:
        p = call_plan(plan, gates)
        for mode in plan.launch_families:
            groups, seen = {}, set()
            for fam, site, knobs in tuning.candidates(p, mode, quick=plan.sweep_quick):
                lists = (site, repr(_lists(p, mode, {(fam, site): knobs})))
                if lists not in seen:
                    seen.add(lists)
                    groups.setdefault((fam, site), []).append((fam, site, knobs))
            out += [(gates, mode, p, key, cands) for key, cands in groups.items()]
    return out


def _env(plan, gates, mode, p):
    if (gates, mode) not in _ENVS:
        _ENVS.clear()  # one call's inputs at a time (~1 GB at the reference shape)
        _ENVS[(gates, mode)] = inputs(p, plan.device)
    return dict(_ENVS[(gates, mode)])


def measure(plan, gates, mode, p, cand, which, rep_ms):
    """[microseconds] of the launches `which` of one candidate's call (module doc): each
    alone, or a whole phase's list in order for (phase, -1)."""
    from bridge.torch_runner import run

    from parity.bench import gpu

    fam, site, knobs = cand
    env = _env(plan, gates, mode, p)
    lists = _lists(p, mode, {(fam, site): knobs})
    fwd_out = run(lists[0], env, autotune=False)
    env.update(fwd_out)
    run(lists[1], env, autotune=False)
    times = []
    for phase, i in which:
        launches = lists[phase] if i < 0 else [lists[phase][i]]
        times.append(gpu.bench(lambda: run(launches, env, autotune=False), plan.device,
                               warmup_ms=max(rep_ms // 4, 1), rep_ms=rep_ms, host_calls=1)
                     * 1e3)
    return times


def ahead_calls(plan):
    """[(label, thunk)]: each candidate's call once (its compiles), for ahead.py."""
    out = []
    for gates, mode, p, _, cands in by_site(plan):
        for cand in cands:
            out.append((f"sweep {gates} {cand[1]} {cand[2]}",
                        lambda c=cand, g=gates, m=mode, pp=p: measure(plan, g, m, pp, c, [], 1)))
    return out


def run(emit, deadline, *, plan, out_path):
    """Every candidate timed, guarded; the winners written as a device table."""
    device = tuning.device_key() if not plan.dry else DRY_DEVICE
    winners, report = {}, []
    for gates, mode, p, (fam, site), cands in by_site(plan):
        which = affected(p, mode, site, cands)
        if not which:  # one candidate (the defaults): nothing to choose
            continue
        got = []
        for cand in cands:
            row = dict(gates=gates, family=fam, site=site, knobs=cand[2],
                       default=cand is cands[0])
            if time.monotonic() > deadline:
                emit("candidate", **row, status="not_reached",
                     error="not reached before the step's cap")
                continue
            try:
                times = measure(plan, gates, mode, p, cand, which, plan.sweep_rep_ms)
                emit("candidate", **row, us=sum(times), launches=times, status="ok", error=None)
                got.append((sum(times), cand))
            except Exception as e:
                emit("candidate", **row, **failure(e))
        if not got or got[0][1] is not cands[0]:
            continue  # the defaults were not measured: nothing to compare with
        default_us = got[0][0]
        best_us, best = min(got, key=lambda x: x[0])
        chosen = best if best_us < (1 - MARGIN) * default_us else cands[0]
        us = best_us if chosen is best else default_us
        report.append(dict(gates=gates, family=fam, site=site, knobs=chosen[2], us=us,
                           default_us=default_us, default=cands[0][2], candidates=len(got)))
        if chosen is not cands[0]:
            winners[tuning.entry_key(p, fam, site)] = chosen[2]
    import json

    table = tuning.table_of(device or "unknown device", f"python -m parity.gpu sweep, "
                            f"{time.strftime('%Y-%m-%d')}", winners)
    with open(out_path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    return {"device": device, "winners": report, "entries": len(winners), "table": out_path,
            "shape": [plan.B, plan.sweep_T, plan.H, plan.K, plan.V], "margin": MARGIN,
            "dtype": "fp32" if plan.dry else "bf16"}
