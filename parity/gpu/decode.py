"""Step 5: decoding. The GLA layer (hidden 2048, 4 heads: K=256, V=512, bf16; fla's GLA
shape) generating one token a step with its state, at batch 1, 8 and 64, against the
same layer (same weights) whose recurrence is fla's fused_recurrent_gla: ms per token,
eager, each output fed back as the next input (parity.bench.decode's loop), median of
alternating runs. The two agree on one step from the same state before anything is timed."""

import statistics
import time

from parity.bench.decode import _generate
from parity.compare import rel_err

from . import fla as fla_mod


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


def run(emit, deadline, *, plan):
    import torch

    fns, why = fla_mod.ops(plan)
    if fns is None:
        return {"fla": why}
    if not plan.dry:
        fla_mod.no_autotune()
    ours, ref, dtype = _pair(plan, fns)
    sync = (lambda _: None) if plan.dry else (lambda _: torch.cuda.synchronize())
    steps = {"ours": lambda x, s: ours(x, state=s, use_cache=True),
             "fla": lambda x, s: ref(x, state=s, use_cache=True)}
    with torch.no_grad():
        for B in plan.decode_batches:
            row = dict(batch=B)
            if time.monotonic() > deadline:
                emit("row", **row, error="not reached before the step's cap")
                continue
            try:
                x, s = _start(plan, B, dtype)
                (o1, s1), (o2, s2) = steps["ours"](x, s), steps["fla"](x, s)
                row["vs_fla"] = max(rel_err(o1.float().cpu().numpy(), o2.float().cpu().numpy()),
                                    rel_err(s1.float().cpu().numpy(), s2.float().cpu().numpy()))
                times = {"ours": [], "fla": []}
                for i in range(2 + plan.decode_runs):  # two warm-up runs, then alternating
                    for name, step in steps.items():
                        sync(None)
                        t = _generate(step, x, s, plan.decode_steps, sync)
                        if i >= 2:
                            times[name].append(t * 1e3)
                row.update(ours_ms=statistics.median(times["ours"]),
                           fla_ms=statistics.median(times["fla"]), error=None)
                emit("row", **row)
            except Exception as e:
                emit("row", **row, error=f"{type(e).__name__}: {str(e)[:300]}")
    hidden, heads = plan.decode_layer
    return {"hidden": hidden, "heads": heads, "steps": plan.decode_steps,
            "runs": plan.decode_runs, "dtype": str(dtype).replace("torch.", ""),
            "fla": "stand-in: a plain per-step torch loop" if plan.dry else None}
