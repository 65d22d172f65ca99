"""Where the forward's time goes, per stage, at T=4096 (both CPU paths), before and after
issue 19's streamed forwards.

    python -m parity.bench.profile FRAMEWORK OUT.json [--quick]

JAX: each stage of the all-chunks forward (the forward before issue 19; still the one
differentiated with cu_seqlens, gv or float64, and the in-chunk step the slab backward
recomputes) jitted alone on its real inputs (chunk layout, 64-token chunks),
the 16-block in-chunk weights that replaced the tree, and the whole forwards. torch: the
operators with the most self time (torch.profiler) in the forward under autograd and
without it (both stream slabs since the slab backward; before it, the autograd forward
kept what its backward read).
`run` starts one child per framework, as the CPU sweep does.
"""

import time

from . import children, timing, verify

SHAPES = [(2, 8, 64, 64), (1, 4, 128, 128)]
T, QUICK_T, C, REPEATS = 4096, 256, 64, 5


def _time(fn, *args, block=lambda x: x):
    for _ in range(2):
        block(fn(*args))
    ts = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        block(fn(*args))
        ts.append(time.perf_counter() - t0)
    return timing.median(ts)


def jax_stages(shape, T):
    """[(stage, seconds)] of the JAX forward at (B,H,K,V) = shape."""
    import jax
    import jax.numpy as jnp

    from bridge.contract import check
    from jax_side import xla, xla_decay, xla_intra
    from parity.bench.anchors import lax_scan_gla

    B, H, K, V = shape
    a = verify.inputs(B, T, H, K, V, seed=1)
    q, k, v, g = (jnp.asarray(a[n]) for n in ("q", "k", "v", "g"))
    plan = check(q, k, v, g=g)
    S = T // C
    layout = jax.jit(lambda x: x.reshape(B, S, C, H, x.shape[-1]).transpose(1, 0, 3, 2, 4)
                     .reshape(-1, C, x.shape[-1]))
    cq, ck, cv, cg = (jax.block_until_ready(layout(x)) for x in (q, k, v, g))
    ka = jax.block_until_ready(jax.jit(xla_decay.local)(cg))
    p = jax.block_until_ready(jax.jit(xla_intra.tree_p)(cq, ck, ka))

    def decays(q, k, ka):
        into, out = xla_decay.spans(ka, C)
        return q * jnp.exp(into), k * jnp.exp(out), jnp.exp(jnp.sum(ka.tau, 1))

    q_in, k_up, dA = jax.block_until_ready(jax.jit(decays)(cq, ck, ka))
    u = jnp.einsum("zck,zcv->zkv", k_up, cv)

    def scan(dA, u):
        def step(s, x):
            return s * x[0][..., None] + x[1], s
        return jax.lax.scan(step, jnp.zeros((B * H, K, V)),
                            (dA.reshape(S, B * H, K), u.reshape(S, B * H, K, V)))[1]

    starts = jax.block_until_ready(jax.jit(scan)(dA, u)).reshape(-1, K, V)
    block = jax.block_until_ready
    rows = [
        ("relayout of q, k, v, g into 64-token chunks (4 arrays)",
         sum(_time(layout, x, block=block) for x in (q, k, v, g))),
        ("in-block log-gate sums (16-token blocks)",
         _time(jax.jit(xla_decay.local), cg, block=block)),
        ("in-chunk weights P [C,C]: the binary tree (before; still the differentiated path)",
         _time(jax.jit(xla_intra.tree_p), cq, ck, ka, block=block)),
        ("in-chunk weights P [C,C]: one matmul against the chunk start (after)",
         _time(jax.jit(xla_intra.block_p), cq, ck, ka, block=block)),
        ("in-chunk output P @ v", _time(jax.jit(lambda p, v: p @ v), p, cv, block=block)),
        ("chunk decays (exp of the spans) on q and k",
         _time(jax.jit(decays), cq, ck, ka, block=block)),
        ("state updates k^T v", _time(jax.jit(lambda k, v: jnp.einsum("zck,zcv->zkv", k, v)),
                                      k_up, cv, block=block)),
        ("state scan over chunks", _time(jax.jit(scan), dA, u, block=block)),
        ("inter-chunk output q S", _time(jax.jit(lambda q, s: jnp.einsum("zck,zkv->zcv", q, s)),
                                         q_in, starts, block=block)),
        ("whole forward, all chunks at once (before)",
         _time(jax.jit(lambda *x: xla.all_chunks(plan, *x, None, None, None, None, None, C)),
               q, k, v, g, block=block)),
        ("whole forward, streamed slabs (after)",
         _time(jax.jit(lambda *x: xla.streamed(plan, *x)), q, k, v, g, block=block)),
        ("lax.scan per step (reference)", _time(jax.jit(lax_scan_gla), q, k, v, g, block=block)),
    ]
    return rows


def torch_stages(shape, T, top=6):
    """[(stage, seconds)]: the top operators by self CPU time of each torch forward."""
    import torch

    from bridge.contract import check
    from torch_side.native import recurrent_native

    torch.set_num_threads(2)
    B, H, K, V = shape
    a = verify.inputs(B, T, H, K, V, seed=1)
    ins = [torch.from_numpy(a[n]) for n in ("q", "k", "v", "g")]
    plan = check(*ins[:3], g=ins[3])

    def keeping():  # the autograd path (since the slab backward, it keeps only the inputs)
        leaves = [x.detach().requires_grad_() for x in ins]
        return recurrent_native(plan, *leaves[:3], g=leaves[3])

    def streaming():
        with torch.no_grad():
            return recurrent_native(plan, *ins[:3], g=ins[3])

    rows = []
    for name, fn in (("under autograd (keeps the inputs)", keeping),
                     ("streamed slabs, no autograd (after)", streaming)):
        rows.append((f"torch forward {name}, whole call", _time(fn)))
        with torch.profiler.profile() as prof:
            fn()
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        rows += [(f"- {e.key} x{e.count}", e.self_cpu_time_total * 1e-6) for e in ops]
    return rows


def measure(framework, quick=False):
    shapes = [(1, 2, 16, 16)] if quick else SHAPES
    t = QUICK_T if quick else T
    fn = torch_stages if framework == "torch" else jax_stages
    return [{"framework": framework, "shape": list(s), "T": t,
             "rows": [[n, float(x)] for n, x in fn(s, t)]} for s in shapes]


def run(log=print, quick=False) -> list:
    """Both frameworks, each in a child process; their tables."""
    return children.per_framework("parity.bench.profile", log, quick)


def section(tables) -> str:
    if not tables:
        return "not measured in this run."
    lines = ["Each JAX stage jitted alone on its real inputs (median of "
             f"{REPEATS} calls after 2; stages overlap with nothing, so their sum is not the "
             "whole forward: XLA fuses across stages inside one program). torch: self CPU time "
             "of the top operators in one profiled call (summed over both threads' work), and "
             "the whole call's wall time.", ""]
    for t in tables:
        if "error" in t:
            lines += [f"- {t['framework']}: not measured ({t['error']})", ""]
            continue
        lines += [f"**{t['framework']}, (B,H,K,V) = {tuple(t['shape'])}, T = {t['T']}**", "",
                  "| stage | ms |", "|---|---|"]
        lines += [f"| {n} | {x * 1e3:.1f} |" for n, x in t["rows"]]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    children.child_main(measure)
