"""The sweep: every implementation, verified, then timed side by side over T.

Result records (one per shape, mode, T, implementation), plain JSON values:
    {"shape": [B,H,K,V], "mode": "fwd"|"fwdbwd", "T": int, "impl": name,
     "framework": "torch"|"jax", "status": "ok"|"over budget"|"error"|"skipped"|
     "wrong"|"missing", "reason": str, "times_s": [...], "median_s": float|None,
     "peak_bytes": int|None, "flops": int}
"""

import sys
import time

from . import flops as flopsmod
from . import timing, verify

MODES = ("fwd", "fwdbwd")
# peak memory: the least of MEMORY_TRIES calls for a call under MEMORY_ONCE_S, else one
MEMORY_TRIES, MEMORY_ONCE_S = 3, 1.0


class Settings:
    """Budget knobs. budget_s: a call slower than this stops T growing for that
    anchor ("over budget" for the larger T; our own paths, Impl.budgeted=False, are
    always measured); rep_budget_s: time spent on
    the timed calls of one point (at least min_repeats, at most repeats calls);
    warm-up: see _warm_up."""

    def __init__(self, budget_s=10.0, rep_budget_s=2.0, min_repeats=2, repeats=7,
                 measure_memory=True, log=None):
        self.budget_s, self.rep_budget_s = budget_s, rep_budget_s
        self.min_repeats, self.repeats = min_repeats, repeats
        self.measure_memory = measure_memory
        self.warm_calls, self.warm_cap_s = 6, 30.0
        t0 = time.perf_counter()
        self.log = log if log is not None else (lambda msg: print(
            f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True))


def _record(shape, mode, T, impl, status, reason="", times=(), peak=None):
    B, H, K, V = shape
    times = [float(t) for t in times]
    return {"shape": list(shape), "mode": mode, "T": T, "impl": impl.name,
            "framework": impl.framework, "status": status, "reason": reason,
            "times_s": times, "median_s": timing.median(times) if times else None,
            "peak_bytes": peak, "flops": flopsmod.flops(B, T, H, K, V, mode)}


def _error(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {(text[0] if text else '')[:160]}"


def check_all(impls, log) -> dict:
    """{impl name: {"fwd": reason|None, "fwdbwd": reason|None}} from verify.check."""
    a = verify.inputs(**verify.CHECK_SIZE)
    ref = verify.reference(a)
    out = {}
    for impl in impls:
        why = impl.missing()
        out[impl.name] = {m: why for m in MODES} if why else verify.check(impl, a, ref)
        log(f"check {impl.name}: {out[impl.name]}")
    return out


def sweep(impls, shapes, Ts, settings: Settings, checks: dict) -> list:
    """Time and measure every (shape, mode, T, impl); see the module docstring."""
    log = settings.log
    records = []
    for shape in shapes:
        B, H, K, V = shape
        for mode in MODES:
            stopped = {}  # impl name -> (status, reason) for every larger T
            for impl in impls:
                why = checks[impl.name][mode]
                if why:
                    status = ("missing" if why.startswith("not installed") else
                              "wrong" if why.startswith("wrong") else "error")
                    stopped[impl.name] = (status, why)
            for T in sorted(Ts):
                arrays = verify.inputs(B, T, H, K, V, seed=1)
                live = []
                for impl in impls:
                    if impl.name in stopped:
                        status, why = stopped[impl.name]
                        records.append(_record(shape, mode, T, impl, status, why))
                        continue
                    limit = impl.limit(B, T, H, K, V) if impl.limit else None
                    if limit:
                        records.append(_record(shape, mode, T, impl, "skipped", limit))
                        continue
                    live.append(impl)
                records += _measure_point(shape, mode, T, live, arrays, settings, stopped)
                here = [r for r in records
                        if r["shape"] == list(shape) and r["mode"] == mode and r["T"] == T]
                log(f"{shape} {mode} T={T}: " + ", ".join(
                    f"{r['impl']}="
                    f"{r['median_s'] if r['median_s'] is None else round(r['median_s'], 4)}"
                    for r in here))
    return records


def _warm_up(fn, settings, budgeted=True) -> float:
    """Call fn until two calls in a row agree within 25% (the first compiles; on this
    VM memory the process has not touched for a while costs up to 30x on first use),
    at most `warm_calls` calls or `warm_cap_s` seconds. Returns the last call's time.
    Raises TimeoutError when even the warm-up cannot finish one steady call in time."""
    cap = max(settings.warm_cap_s, 4 * settings.budget_s)
    times = []
    while True:
        times.append(timing.timed(fn))
        if len(times) >= 3 and max(times[-2:]) <= 1.25 * min(times[-2:]):
            return times[-1]
        if len(times) >= settings.warm_calls or sum(times) > cap:
            if len(times) == 1 and budgeted:  # only the compiling call fit in the cap
                raise TimeoutError(f"warm-up: the first call (JAX: with compile) took "
                                   f"{times[0]:.1f} s > {cap:g} s")
            return times[-1]


def _measure_point(shape, mode, T, impls, arrays, settings, stopped) -> list:
    """Warm up each implementation, then alternate timed calls between them."""
    runs, first, out = {}, {}, {}
    for impl in impls:
        try:
            fns = impl.build(arrays)
            fn = fns[0] if mode == "fwd" else fns[1]
            first[impl.name] = _warm_up(fn, settings, impl.budgeted)
            runs[impl.name] = fn
        except Exception as e:
            reason = (f"over budget: {e}" if isinstance(e, TimeoutError)
                      else f"error at T={T}: {_error(e)}")
            status = "over budget" if isinstance(e, TimeoutError) else "error"
            out[impl.name] = _record(shape, mode, T, impl, status, reason)
            stopped[impl.name] = (status, reason)
    # Samples per implementation: the warm second call, plus as many alternating
    # calls as fit the repeat budget (2..repeats); 1 when that call was over budget.
    budgeted = {i.name for i in impls if i.budgeted}
    counts = {name: 1 if t > settings.budget_s and name in budgeted else
              max(settings.min_repeats,
                  min(settings.repeats, int(settings.rep_budget_s / max(t, 1e-9))))
              for name, t in first.items()}
    times = {name: [first[name]] for name in runs}
    for r in range(1, max(counts.values(), default=0)):
        for name, fn in runs.items():  # alternate: one call of each per round
            if r < counts[name]:
                times[name].append(timing.timed(fn))
    for impl in impls:
        if impl.name not in runs:
            continue
        name = impl.name
        peak = None
        if settings.measure_memory:
            try:
                tries = MEMORY_TRIES if first[name] < MEMORY_ONCE_S else 1
                peak = timing.peak_memory_bytes(runs[name], tries)
            except OSError:
                peak = None
        reason = ""
        if first[name] > settings.budget_s and name in budgeted:  # report this call, stop growing T
            reason = f"one call took {first[name]:.1f} s > budget {settings.budget_s:g} s"
            stopped[name] = ("over budget", f"over budget (at T={T}: {reason})")
        out[name] = _record(shape, mode, T, impl, "ok", reason, times[name], peak)
    return [out[i.name] for i in impls if i.name in out]
