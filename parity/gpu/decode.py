"""Step "decode": decoding. The GLA layer (hidden 2048, 4 heads: K=256, V=512, bf16; fla's GLA
shape) generating one token a step with its state, at batch 1, 8 and 64, against the
same layer (same weights) whose recurrence is fla's fused_recurrent_gla: ms per token,
eager, each output fed back as the next input (parity.bench.decode's loop), median of
alternating runs. Each layer at each batch is its own row (parity/gpu/rows.py): ours is
measured whether or not fla's runs; each output of one step from the same state is
compared with ours before anything is timed."""

import statistics
import time

from parity.bench.decode import time_per_token
from parity.compare import rel_err

from . import fla as fla_mod
from .rows import failure
from .standins import failing

OURS = "ours"


def _pair(plan, fns):
    """(ours, fla's or None without fns, dtype): GLA layers with the same weights, on the
    plan's device and dtype."""
    import torch

    from torch_side import layers

    hidden, heads = plan.decode_layer
    dtype = torch.float32 if plan.dry else torch.bfloat16
    torch.manual_seed(0)
    ours = layers.GatedLinearAttention(hidden_size=hidden, num_heads=heads, platform="triton")
    if fns is None:
        return ours.to(plan.device, dtype), None, dtype
    fused = fns["fused_recurrent_gla"]

    class FlaGLA(layers.GatedLinearAttention):
        def _recurrence(self, q, k, v, gk, mask, cu_seqlens, state):
            return fused(q, k, v, gk=gk, initial_state=state, output_final_state=True)

    ref = FlaGLA(hidden_size=hidden, num_heads=heads)
    ref.load_state_dict(ours.state_dict())
    return ours.to(plan.device, dtype), ref.to(plan.device, dtype), dtype


def _start(plan, B, dtype):
    import torch

    hidden, heads = plan.decode_layer
    gen = torch.Generator(device=plan.device).manual_seed(B)
    x = torch.randn(B, 1, hidden, device=plan.device, generator=gen).to(dtype)
    K, V = hidden // 2 // heads, hidden // heads
    return x, torch.zeros(B, heads, K, V, device=plan.device)


def _steps(plan, fns, which):
    """A thunk: one decoding step of ours (which=0) or fla's layer (1) at each batch."""
    def thunk():
        import torch

        pair = _pair(plan, fns)
        with torch.no_grad():
            for B in plan.decode_batches:
                x, s = _start(plan, B, pair[2])
                pair[which](x, state=s, use_cache=True)
    return thunk


def ours_calls(plan):
    return [("decode ours", _steps(plan, None, 0))]


def fla_calls(plan):
    fns, _ = fla_mod.ops(plan)
    return [] if fns is None else [("decode fused_recurrent_gla", _steps(plan, fns, 1))]


def names(plan) -> list:
    """The layers this step times, in order: ours, fla's (and the failing stand-in)."""
    fails = ["stand-in that fails"] if "failing-impl" in plan.faults else []
    return fails + [OURS, ("stand-in for " if plan.dry else "") + "fla fused_recurrent_gla"]


def expected(plan) -> list:
    return [dict(impl=n, batch=B) for B in plan.decode_batches for n in names(plan)]


def _timings(plan, steps, x, s, sync, deadline):
    """{name: ms per token, or the failure} of each step function: one call each (the
    layers' outputs compared there), two warm-up runs, then runs alternating over the
    ones that have not failed."""
    out, times = {}, {n: [] for n in steps}
    for i in range(2 + plan.decode_runs):
        for name, step in steps.items():
            if name in out:
                continue
            if time.monotonic() > deadline:
                out[name] = {"status": "not_reached", "error": "not reached before the step's cap"}
                continue
            try:
                sync(None)
                t = time_per_token(step, x, s, plan.decode_steps, sync)
                if i >= 2:
                    times[name].append(t * 1e3)
            except Exception as e:
                out[name] = failure(e)
    for name, ts in times.items():
        if name not in out:
            out[name] = {"status": "ok", "error": None, "ms": statistics.median(ts)}
    return out


def run(emit, deadline, *, plan, configs=None):
    """Each layer at each batch, guarded; ours whether or not fla's runs (module doc)."""
    import torch

    fns, why, _ = fla_mod.prepare(plan, configs)
    ours, ref, dtype = _pair(plan, fns)
    sync = (lambda _: None) if plan.dry else (lambda _: torch.cuda.synchronize())
    fla_name = names(plan)[-1]
    steps = {n: failing for n in names(plan)[:-2]}
    steps[OURS] = lambda x, s: ours(x, state=s, use_cache=True)
    if ref is not None:
        steps[fla_name] = lambda x, s: ref(x, state=s, use_cache=True)
    with torch.no_grad():
        for B in plan.decode_batches:
            x, s = _start(plan, B, dtype)
            first = {}
            for name, step in steps.items():  # one step from the same state, compared
                try:
                    o, s1 = step(x, s)
                    first[name] = (o.float().cpu().numpy(), s1.float().cpu().numpy())
                except Exception:  # the timings below report it
                    pass
            got = _timings(plan, steps, x, s, sync, deadline)
            for name in names(plan):
                row = dict(impl=name, batch=B, **got.get(name, {"status": "absent",
                                                                "error": why}))
                if name != OURS and name in first and OURS in first:
                    row["vs_ours"] = max(rel_err(a, b) for a, b in zip(first[name], first[OURS]))
                emit("row", **row)
    hidden, heads = plan.decode_layer
    return {"hidden": hidden, "heads": heads, "steps": plan.decode_steps,
            "runs": plan.decode_runs, "dtype": str(dtype).replace("torch.", ""),
            "fla": "stand-in: a plain per-step torch loop" if plan.dry else why}
