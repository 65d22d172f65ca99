"""flash-linear-attention (fla), the anchor, and its autotuner.

fla's GLA kernels autotune on first use (~190 configs over the chunked forward and
backward, each compiled: minutes, serially) and cache the winners on disk (Triton's
`cache_results`, keyed without T). The kit therefore
1. compiles every config in parallel while the GPU runs the correctness step
   (`precompile`: worker i of n benchmarks only configs i, i+n, ...; its timings, taken
   on a shared GPU, are thrown away: FLA_CACHE_RESULTS=0), so that
2. `warm`, alone on the GPU, finds every config compiled and autotunes for real, under a
   cap, caching the winners; and
3. the timed processes call `no_autotune()`: a tuning fla did not finish in the warm-up
   raises NotWarmed (that row is then "not warmed") instead of autotuning in a timing.
The calls made are the steps' own (`speed.fla_calls`, `varlen.fla_calls`,
`decode.fla_calls`), so the warm-up tunes exactly what is timed.
"""

import os

from .standins import FLA_STANDINS


class NotWarmed(RuntimeError):
    """fla would autotune in a timed process (its warm-up did not reach this kernel)."""


def ops(plan):
    """({"chunk_gla": fn, "fused_recurrent_gla": fn}, None) or (None, why absent); the
    CPU stand-ins in the dry run."""
    if plan.dry:
        return dict(FLA_STANDINS), None
    try:
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
    except Exception as e:  # not installed, or broken against this torch/triton
        return None, f"fla-core unavailable ({type(e).__name__}: {str(e)[:200]})"
    return {"chunk_gla": chunk_gla, "fused_recurrent_gla": fused_recurrent_gla}, None


def no_autotune():
    """From now on in this process, any Triton autotuning raises NotWarmed."""
    from triton.runtime import autotuner

    def refuse(self, *args, **kwargs):
        raise NotWarmed(f"fla's autotuner for {self.base_fn.__name__} was not warmed "
                        "within the warm-up's cap")
    autotuner.Autotuner._bench = refuse


def _subset(i, n):
    """Make every Triton autotuner in this process benchmark only configs i, i+n, ..."""
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs

    def pruned(self, *args, **kwargs):
        configs = prune(self, *args, **kwargs)
        return configs[i % len(configs)::n] or configs[:1]
    autotuner.Autotuner.prune_configs = pruned


def _calls(plan):
    """Every fla call the timed steps make: [(label, thunk)]."""
    from . import decode, speed, varlen

    return speed.fla_calls(plan) + varlen.fla_calls(plan) + decode.fla_calls(plan)


def _run_calls(emit, deadline, plan):
    import time

    done = 0
    for label, thunk in _calls(plan):
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


def precompile(emit, deadline, *, plan, worker, workers):
    """Child: compile this worker's share of every fla autotune config (module doc, 1)."""
    os.environ["FLA_CACHE_RESULTS"] = "0"
    fla, why = ops(plan)
    if fla is None:
        return {"skipped": why}
    if plan.dry:
        return {"stand_in": "fla's stand-ins have no autotuner: nothing to compile"}
    _subset(worker, workers)
    return {"calls": _run_calls(emit, deadline, plan)}


def warm(emit, deadline, *, plan):
    """Child: fla's real autotuning, alone on the GPU, cached on disk (module doc, 2)."""
    fla, why = ops(plan)
    if fla is None:
        return {"skipped": why}
    if plan.dry:
        return {"stand_in": "fla's stand-ins have no autotuner: nothing to warm"}
    return {"calls": _run_calls(emit, deadline, plan)}
