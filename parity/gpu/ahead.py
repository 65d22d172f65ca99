"""Compiling and tuning ahead of the timed steps, so that no timing child spends its cap
compiling and no timing includes autotuning.

Triton caches compiled kernels on disk, keyed by source and specialization, so any
process that runs a call compiles it for every later one. While the correctness step
runs (CPU-bound compiles beside the tests), background children therefore run:
- `ours` (worker i of n): the calls of ours that speed, varlen, decode and kernels will
  time, once each, then the config sweep's candidates (parity/gpu/sweep.py);
- `fla_compile` (worker i of n): fla's calls with every Triton autotuner limited to its
  configs i, i+n, ...: all of fla's configs get compiled; the timings these workers
  take on a shared GPU are thrown away (FLA_CACHE_RESULTS=0 keeps them off the disk).
  Given winners (--fla-configs), only those compile.
Then the tune step, alone on the GPU, runs `fla_tune`: fla's calls with its real
autotuner, which finds its configs compiled and benchmarks them; the winners go to
OUT/fla-configs.json (`fla.write_winners`), which every timed child loads before it
refuses to tune (`fla.prepare`). Given winners (--fla-configs), the kit copies them
there and nothing is tuned. fla's cold tuning time is the compile workers' wall time
plus this one's.
"""

import os
import time

from . import decode, fla, kernels, speed, sweep, varlen


def fla_calls(plan, tuning=False):
    """Every fla call the timed steps make: [(label, thunk)]. `tuning`: the tune step's,
    which skip the decode step's calls under the dry run's "fla-cold-decode" fault."""
    cold = tuning and "fla-cold-decode" in plan.faults
    return (speed.fla_calls(plan) + varlen.fla_calls(plan)
            + ([] if cold else decode.fla_calls(plan)) + kernels.fla_calls(plan))


def run_calls(emit, deadline, plan, calls):
    """Run labelled thunks in order until the deadline; a row per call; how many ran."""
    done = 0
    for label, thunk in calls:
        if time.monotonic() > deadline:
            emit("call", label=label, status="not_reached", error="not reached before the cap")
            continue
        t0 = time.monotonic()
        try:
            thunk()
            if not plan.dry:
                import torch

                torch.cuda.synchronize()
            emit("call", label=label, seconds=round(time.monotonic() - t0, 2), status="ok",
                 error=None)
            done += 1
        except Exception as e:
            emit("call", label=label, status="error",
                 error=f"{type(e).__name__}: {str(e)[:300]}")
    return done


def ours_calls(plan):
    """The timed steps' calls of ours, then the sweep's candidates."""
    return (speed.ours_calls(plan) + varlen.ours_calls(plan) + decode.ours_calls(plan)
            + sweep.ahead_calls(plan))


def ours(emit, deadline, *, plan, worker, workers):
    """Child: this worker's share of our calls (module doc)."""
    if plan.dry:
        return {"stand_in": "Triton's interpreter compiles nothing: nothing to compile ahead"}
    return {"calls": run_calls(emit, deadline, plan, ours_calls(plan)[worker::workers])}


def fla_compile(emit, deadline, *, plan, worker, workers, configs=None):
    """Child: this worker's share of fla's autotune configs, compiled (module doc)."""
    os.environ["FLA_CACHE_RESULTS"] = "0"  # read when fla is imported, just below
    fns, why = fla.ops(plan)
    if fns is None:
        return {"skipped": why}
    if configs:
        loaded = fla.load_winners(fla.read_winners(configs), fla.modules(plan))
        if worker:  # one worker compiles the winners
            return {"calls": 0, "winners_loaded": loaded}
    else:
        fla.subset(worker, workers)
    return {"calls": run_calls(emit, deadline, plan, fla_calls(plan))}


def fla_tune(emit, deadline, *, plan, out_path):
    """Child: fla's real autotuning alone on the GPU, its winners written to `out_path`."""
    fns, why = fla.ops(plan)
    if fns is None:
        return {"skipped": why}
    t0 = time.monotonic()
    calls = run_calls(emit, deadline, plan, fla_calls(plan, tuning=True))
    n = fla.write_winners(out_path, plan, "tuned by this run's tune step")
    return {"source": "tuned in this run", "winners": n, "tuned": True, "calls": calls,
            "tune_s": round(time.monotonic() - t0, 2)}
