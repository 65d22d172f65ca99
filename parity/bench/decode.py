"""Decoding: time per generated token of the GLA layer (one token a step with its state,
`use_cache`), ours next to the same layer whose recurrence is a plain per-step update
written in the same framework (same weights, same projections; only the recurrence differs).

    python -m parity.bench.decode FRAMEWORK OUT.json [--quick]

runs one framework (torch or jax) in this process and writes its rows; `run` starts one
such child per framework, as the CPU sweep does (a process that has run XLA times torch
differently).
"""

import time

from . import children, timing

HIDDEN, HEADS, BATCHES, STEPS = 1024, 8, (1, 8), 32
QUICK = dict(hidden=64, heads=2, batches=(1, 2), steps=4)


def plain_torch(q, k, v, g=None, initial_state=None, **_):
    """S <- exp(g_t) S + k_t^T v_t, o_t = K^-1/2 q_t S, one torch step a token (the reference)."""
    import torch

    B, T, H, K = q.shape
    S = (initial_state.float() if initial_state is not None
         else torch.zeros(B, H, K, v.shape[-1]))
    os_ = []
    for t in range(T):
        S = torch.exp(g[:, t].float())[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        os_.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S))
    return torch.stack(os_, 1), S


def plain_jax(q, k, v, g=None, initial_state=None, **_):
    """plain_torch in jax.numpy."""
    import jax.numpy as jnp

    B, T, H, K = q.shape
    S = (initial_state.astype(jnp.float32) if initial_state is not None
         else jnp.zeros((B, H, K, v.shape[-1]), jnp.float32))
    os_ = []
    for t in range(T):
        S = jnp.exp(g[:, t])[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        os_.append(jnp.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S))
    return jnp.stack(os_, 1), S


def _torch_pair(hidden, heads, B):
    """(ours, reference): each a step x [B,1,D], state -> (o, state)."""
    import torch

    from torch_side import layers

    class PlainGLA(layers.GatedLinearAttention):
        def _recurrence(self, q, k, v, gk, mask, cu_seqlens, state):
            return plain_torch(q, k, v, g=gk, initial_state=state)

    torch.manual_seed(0)
    ours = layers.GatedLinearAttention(hidden_size=hidden, num_heads=heads, platform="torch")
    ref = PlainGLA(hidden_size=hidden, num_heads=heads)
    ref.load_state_dict(ours.state_dict())

    def stepper(layer):
        return lambda x, s: layer(x, state=s, use_cache=True)
    return stepper(ours), stepper(ref)


def _jax_pair(hidden, heads, B):
    import functools
    from unittest import mock

    import jax

    from bridge.weights import LayerConfig
    from jax_side import layers

    cfg = LayerConfig(hidden_size=hidden, num_heads=heads, kind="gla")
    params = layers.init_gla(jax.random.PRNGKey(0), cfg)
    apply = functools.partial(layers.gla_apply, config=cfg, use_cache=True, platform="xla")
    ours = jax.jit(lambda x, s: apply(params, x, state=s))
    traced = jax.jit(lambda x, s: apply(params, x, state=s))

    def ref(x, s):  # traced with the plain recurrence in place of the layer's recurrent_gla
        with mock.patch.object(layers, "recurrent_gla", plain_jax):
            return traced(x, s)
    return ours, ref


def time_per_token(step, x, s, steps, block):
    """`steps` tokens, each step's output fed back as the next input; returns s per token."""
    t0 = time.perf_counter()
    for _ in range(steps):
        x, s = step(x, s)
    block((x, s))
    return (time.perf_counter() - t0) / steps


def measure(framework, quick=False):
    """Rows {framework, batch, ours_s, ref_s, err} for each batch size."""
    hidden, heads, batches, steps = ((QUICK["hidden"], QUICK["heads"], QUICK["batches"],
                                      QUICK["steps"]) if quick else (HIDDEN, HEADS, BATCHES, STEPS))
    rows = []
    for B in batches:
        if framework == "torch":
            import numpy as np
            import torch

            torch.set_num_threads(2)
            ours, ref = _torch_pair(hidden, heads, B)
            x = torch.randn(B, 1, hidden)
            K = hidden // 2 // heads
            s = torch.zeros(B, heads, K, hidden // heads)
            block = lambda out: out
            grad = torch.no_grad()
            grad.__enter__()
            diff = lambda a, b: float(np.abs(a.numpy() - b.numpy()).max())
        else:
            import jax
            import jax.numpy as jnp
            import numpy as np

            ours, ref = _jax_pair(hidden, heads, B)
            x = jax.random.normal(jax.random.PRNGKey(1), (B, 1, hidden))
            K = hidden // 2 // heads
            s = jnp.zeros((B, heads, K, hidden // heads))
            block = jax.block_until_ready
            diff = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())
        # the same steps from the same state: outputs must agree before anything is timed
        (o1, s1), (o2, s2) = ours(x, s), ref(x, s)
        err = max(diff(o1, o2), diff(s1, s2))
        for _ in range(1 if quick else 2):  # warm-up (compiles)
            time_per_token(ours, x, s, steps, block)
            time_per_token(ref, x, s, steps, block)
        t_ours, t_ref = [], []
        for _ in range(1 if quick else 7):  # alternating
            t_ours.append(time_per_token(ours, x, s, steps, block))
            t_ref.append(time_per_token(ref, x, s, steps, block))
        rows.append({"framework": framework, "batch": B, "hidden": hidden, "heads": heads,
                     "ours_s": timing.median(t_ours), "ref_s": timing.median(t_ref),
                     "max_abs_diff": err})
        if framework == "torch":
            grad.__exit__(None, None, None)
    return rows


def run(log=print, quick=False) -> list:
    """Both frameworks, each in a child process; their rows."""
    return children.per_framework("parity.bench.decode", log, quick)


def section(rows) -> str:
    """The markdown table (and a line per failed framework)."""
    if not rows:
        return "not measured in this run."
    ok = [r for r in rows if "error" not in r]
    lines = []
    if ok:
        r0 = ok[0]
        lines += [f"GLA layer, hidden {r0['hidden']}, {r0['heads']} heads, float32, one token a "
                  f"step with its state (`use_cache`), {STEPS} steps per timed run, each "
                  "output fed back as the next input; median of alternating runs. The reference "
                  "is the same layer (same weights and projections) with the recurrence replaced "
                  "by a plain per-step update in the same framework (torch eager under no_grad; "
                  "JAX: the whole step jitted). The two agree before timing (max |difference| "
                  "of outputs and states shown).", "",
                  "| framework | batch | ours ms/token | plain per-step ms/token "
                  "| reference / ours | max abs diff | target: ours no slower |",
                  "|---|---|---|---|---|---|---|"]
        for r in ok:
            ratio = r["ref_s"] / r["ours_s"]
            lines.append(f"| {r['framework']} | {r['batch']} | {r['ours_s'] * 1e3:.3f} | "
                         f"{r['ref_s'] * 1e3:.3f} | {ratio:.2f}x | {r['max_abs_diff']:.1e} | "
                         f"{'met' if ratio >= 1.0 else 'NOT met'} |")
    for r in rows:
        if "error" in r:
            lines.append(f"- {r['framework']}: not measured ({r['error']})")
    return "\n".join(lines)


if __name__ == "__main__":
    children.child_main(measure)
