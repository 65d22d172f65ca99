"""Compiling and tuning ahead of the timed steps, so that no timing child spends its cap
compiling and no timing includes autotuning.

Triton caches compiled kernels on disk, keyed by source and specialization, so any
process that runs a call compiles it for every later one. While the correctness step
runs (CPU-bound compiles beside the tests), background children therefore run:
- `ours` (worker i of n): the calls of ours that speed, varlen and decode will time
  (`ours_calls` of each: torch and JAX launches, the per-launch variants, the packed
  and decoding shapes), once each;
- `fla_compile` (worker i of n): fla's calls with every Triton autotuner limited to its
  configs i, i+n, ...: all of fla's ~190 configs get compiled; the timings these workers
  take on a shared GPU are thrown away (FLA_CACHE_RESULTS=0 keeps them off the disk).
Then, at the start of the speed step and alone on the GPU, `fla_tune` runs fla's calls
with its real autotuner, which finds every config compiled, benchmarks them and caches
the winners on disk (fla's `cache_results`; its keys leave T out). The timed children
then refuse to autotune (`fla.no_autotune`): what the tuning did not reach within its
cap shows as "not warmed" rather than as a timing that includes autotuning.
"""

import os
import time

from . import decode, fla, speed, varlen


def fla_calls(plan):
    """Every fla call the timed steps make: [(label, thunk)]."""
    return speed.fla_calls(plan) + varlen.fla_calls(plan) + decode.fla_calls(plan)


def run_calls(emit, deadline, plan, calls):
    """Run labelled thunks in order until the deadline; a row per call; how many ran."""
    done = 0
    for label, thunk in calls:
        if time.monotonic() > deadline:
            emit("call", label=label, error="not reached before the cap")
            continue
        t0 = time.monotonic()
        try:
            thunk()
            if not plan.dry:
                import torch

                torch.cuda.synchronize()
            emit("call", label=label, seconds=round(time.monotonic() - t0, 2))
            done += 1
        except Exception as e:
            emit("call", label=label, error=f"{type(e).__name__}: {str(e)[:300]}")
    return done


def ours_calls(plan):
    from . import decode, speed, varlen

    return speed.ours_calls(plan) + varlen.ours_calls(plan) + decode.ours_calls(plan)


def ours(emit, deadline, *, plan, worker, workers):
    """Child: this worker's share of our calls (module doc)."""
    if plan.dry:
        return {"stand_in": "Triton's interpreter compiles nothing: nothing to compile ahead"}
    return {"calls": run_calls(emit, deadline, plan, ours_calls(plan)[worker::workers])}


def fla_compile(emit, deadline, *, plan, worker, workers):
    """Child: this worker's share of fla's autotune configs, compiled (module doc)."""
    os.environ["FLA_CACHE_RESULTS"] = "0"  # read when fla is imported, just below
    fns, why = fla.ops(plan)
    if fns is None:
        return {"skipped": why}
    if plan.dry:
        return {"stand_in": "fla's stand-ins have no autotuner: nothing to compile"}
    fla.subset(worker, workers)
    return {"calls": run_calls(emit, deadline, plan, fla_calls(plan))}


def fla_tune(emit, deadline, *, plan):
    """Child: fla's real autotuning, alone on the GPU, cached on disk (module doc)."""
    fns, why = fla.ops(plan)
    if fns is None:
        return {"skipped": why}
    if plan.dry:
        return {"stand_in": "fla's stand-ins have no autotuner: nothing to tune"}
    return {"calls": run_calls(emit, deadline, plan, fla_calls(plan))}
