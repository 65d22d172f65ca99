"""Step "speed". Our chunked and fused-recurrent kernels, launched from torch and from
JAX, against fla's chunk_gla and fused_recurrent_gla: forward and forward+backward,
(B,T,H,K,V) = (8,T,16,128,128) for each T of the plan, bf16, GLA's key gate.

Three children, one after the other (never two timings at once), so that neither
fla's failure nor ours takes the other's rows (parity/gpu/rows.py):
- `ours_child`: ours (torch launch), `bench` medians (CUDA events, L2 flushed, inputs
  rotated over sets larger than the L2 together), peak device memory of one call, each
  output against ours chunked; then per-launch times beside their lower bounds.
- `fla_child`: fla's chunk_gla and fused_recurrent_gla the same way, with the
  autotuner winners the tune step wrote (parity/gpu/fla.py), never tuning.
- `jax_child`: ours from JAX (`jax.jit`) and, in the same process and timed the same way,
  ours from torch: JAX runs on its own CUDA stream, so each timed call starts and ends
  with a device synchronization, for both launches alike (the JAX/torch ratio compares
  like with like). Memory: XLA's compiled plan (temp + outputs).
fwd runs without autograd; fwd+bwd is the forward plus the gradients of q, k, v, g
(torch.autograd.grad / jax.grad of sum(o * do)).
"""

import time

import numpy as np

from parity.bench import gpu
from parity.compare import rel_err

from . import fla as fla_mod
from .plan import FAMILIES
from .rows import failure, guarded
from .standins import failing

FAILING = "stand-in that fails"
FLA_NAMES = {"chunk": "chunk_gla", "fused_recurrent": "fused_recurrent_gla"}


def impls(plan, part):
    """[(name, family)] the `part` ("ours", "fla" or "jax") child times, in order."""
    if part == "ours":
        fails = [(FAILING, "chunk")] if "failing-impl" in plan.faults else []
        return fails + [(f"ours {f} (torch)", f) for f in FAMILIES]
    if part == "fla":
        return [(fla_name(plan, f), f) for f in FLA_NAMES]
    return [(f"ours {f} ({launch})", f) for f in plan.jax_families
            for launch in ("jax", "torch, synced")]


def expected(plan, part) -> list:
    """The rows the `part` child must write: one per implementation, T and mode."""
    return [dict(impl=name, family=f, T=size[1], mode=mode) for size in sizes(plan)
            for name, f in impls(plan, part) for mode in ("fwd", "fwdbwd")]


def sizes(plan):
    return [(plan.B, T, plan.H, plan.K, plan.V) for T in plan.Ts]


def fla_name(plan, family):
    return ("stand-in for fla " if plan.dry else "fla ") + FLA_NAMES[family]


def _set_bytes(size):
    B, T, H, K, V = size
    return B * T * H * (3 * K + 2 * V) * 2


def _ours(family):
    import torch_side

    return lambda q, k, v, g: torch_side.recurrent_gla(q, k, v, g, platform="triton",
                                                       mode=family)[0]


def _fla(fns, family):
    fn = fns[FLA_NAMES[family]]
    if family == "chunk":
        return lambda q, k, v, g: fn(q, k, v, g, output_final_state=True)[0]
    return lambda q, k, v, g: fn(q, k, v, gk=g, output_final_state=True)[0]


def _torch_fn(op, next_set, mode, sync=False):
    """A timed call of op on the next input set: the forward without autograd, or
    forward + gradients of q, k, v, g. `sync`: synchronize before and after."""
    import torch

    def call():
        q, k, v, g, do = next_set()
        if sync:
            torch.cuda.synchronize()
        if mode == "fwd":
            with torch.no_grad():
                out = op(q, k, v, g)
        else:
            out = torch.autograd.grad(op(q, k, v, g), (q, k, v, g), do)
        if sync:
            torch.cuda.synchronize()
        return out
    return call


def _leaves(size, device, seed):
    return [x.requires_grad_(i < 4) for i, x in enumerate(gpu.gla_inputs(size, device, seed=seed))]


def _l2(plan):
    if plan.dry:
        return 0
    import torch

    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2 ** 20)


def _late(deadline):
    return time.monotonic() > deadline


def fla_calls(plan):
    """[(label, thunk)]: each fla call the torch child times, once, T = plan.fla_T first
    (fla's tuning keys leave T out: that is where it tunes)."""
    fns, _ = fla_mod.ops(plan)
    if fns is None:
        return []
    out = []
    for size in sorted(sizes(plan), key=lambda s: s[1] != plan.fla_T):
        for family in FLA_NAMES:
            def thunk(size=size, family=family):
                q, k, v, g, do = _leaves(size, plan.device, 0)
                for mode in ("fwd", "fwdbwd"):
                    _torch_fn(_fla(fns, family), lambda: (q, k, v, g, do), mode)()
            out.append((f"speed {FLA_NAMES[family]} T={size[1]}", thunk))
    return out


def ours_calls(plan):
    """[(label, thunk)]: each family's calls of ours this step makes, once, at the smallest
    T (compiles do not depend on T): torch forward and forward+backward, the per-launch
    variants, and the JAX launch (parity/gpu/ahead.py)."""
    size = sizes(plan)[0]
    launch_size = (plan.B, plan.launch_T, plan.H, plan.K, plan.V)
    out = []
    for family in FAMILIES:
        def torch_thunk(family=family):
            q, k, v, g, do = _leaves(size, plan.device, 0)
            for mode in ("fwd", "fwdbwd"):
                _torch_fn(_ours(family), lambda: (q, k, v, g, do), mode)()
            if family in plan.launch_families:
                gpu.launch_times(family, launch_size, 1.0, 1.0, plan.device, rep_ms=1)
        out.append((f"speed ours {family} (torch)", torch_thunk))
    for family in plan.jax_families:
        def jax_thunk(family=family):
            import jax

            ins = [jax.dlpack.from_dlpack(x.detach()) for x in _leaves(size, plan.device, 0)]
            for mode, jitted in zip(("fwd", "fwdbwd"), _jax_ops(family)):
                jax.block_until_ready(jitted(*(ins[:4] if mode == "fwd" else ins)))
        out.append((f"speed ours {family} (jax)", jax_thunk))
    return out


def _jax_ops(family):
    """(jitted forward, jitted gradients of sum(o * do) w.r.t. q, k, v, g) of ours in JAX."""
    import jax
    import jax.numpy as jnp

    import jax_side

    def op(q, k, v, g):
        return jax_side.recurrent_gla(q, k, v, g, platform="triton", mode=family)[0]

    def loss(q, k, v, g, do):
        return jnp.sum(op(q, k, v, g).astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(op), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _measure(emit, plan, deadline, row, call, size, mode, peak=True):
    """Time (and size) one call into a row, guarded (parity/gpu/rows.py)."""
    def measure():
        ms = gpu.bench(call, plan.device, plan.warmup_ms, plan.rep_ms, plan.host_calls)
        tf, gb = gpu.rates(size, mode, ms)
        return dict(ms=ms, peak_bytes=gpu.peak_bytes(call, plan.device) if peak else None,
                    tflops=tf, gbps=gb)
    guarded(emit, "row", row, deadline, measure)


def _reference(first, deadline):
    """Ours chunked forward on one input set (what every output is compared with), or
    None when it fails."""
    import torch

    if _late(deadline):
        return None
    try:
        with torch.no_grad():
            return _ours("chunk")(*first[:4]).float().cpu().numpy()
    except Exception:  # its own row reports the failure
        return None


def _torch_rows(emit, deadline, plan, ops):
    """Each (implementation, T, mode) of `ops` [(name, family, fn, or why absent)]."""
    import torch

    for size in sizes(plan):
        next_set = gpu.rotating(lambda i: _leaves(size, plan.device, i), _set_bytes(size),
                                _l2(plan))
        first = next_set()
        want = _reference(first, deadline)
        for name, family, op in ops:
            row = dict(impl=name, launch="torch", family=family, T=size[1])
            if isinstance(op, str):
                for mode in ("fwd", "fwdbwd"):
                    emit("row", **row, mode=mode, ms=None, status="absent", error=op)
                continue
            agree = None
            if want is not None and not _late(deadline):
                try:
                    with torch.no_grad():
                        agree = rel_err(op(*first[:4]).float().cpu().numpy(), want)
                except Exception:  # the timed call below reports it
                    pass
            for mode in ("fwd", "fwdbwd"):
                _measure(emit, plan, deadline, dict(row, mode=mode, vs_ours_chunk=agree),
                         _torch_fn(op, next_set, mode), size, mode)
        del next_set, first
        if not plan.dry:
            torch.cuda.empty_cache()


def ours_child(emit, deadline, *, plan, tf_peak, gb_peak):
    """Ours (torch launch), then per-launch times (module doc)."""
    ops = [(n, f, failing if n == FAILING else _ours(f)) for n, f in impls(plan, "ours")]
    _torch_rows(emit, deadline, plan, ops)
    launch_size = (plan.B, plan.launch_T, plan.H, plan.K, plan.V)
    for family in plan.launch_families:
        if _late(deadline):
            emit("launch", family=family, status="not_reached",
                 error="not reached before the step's cap")
            continue
        try:
            for r in gpu.launch_times(family, launch_size, tf_peak, gb_peak, plan.device,
                                      rep_ms=max(plan.rep_ms // 5, 1)):
                emit("launch", family=family, T=plan.launch_T, status="ok", error=None, **r)
        except Exception as e:
            emit("launch", family=family, status="error",
                 error=f"{type(e).__name__}: {str(e)[:300]}")
    return {"impls": [n for n, _ in impls(plan, "ours")]}


def fla_child(emit, deadline, *, plan, configs):
    """fla's two ops, with the tune step's winners, never tuning (module doc)."""
    fns, why, loaded = fla_mod.prepare(plan, configs)
    ops = [(n, f, why if fns is None else _fla(fns, f)) for n, f in impls(plan, "fla")]
    _torch_rows(emit, deadline, plan, ops)
    return {"impls": [n for n, _ in impls(plan, "fla")], "fla": why, "winners_loaded": loaded}


def jax_child(emit, deadline, *, plan):
    """Ours from JAX against ours from torch, both synchronized (module doc)."""
    import jax
    import jax.numpy as jnp
    import torch

    sync = (lambda: None) if plan.dry else torch.cuda.synchronize
    for size in sizes(plan):
        torch_sets = gpu.rotating(lambda i: _leaves(size, plan.device, i), _set_bytes(size),
                                  _l2(plan))
        jax_sets = [[jax.dlpack.from_dlpack(x.detach()) for x in torch_sets()]
                    for _ in range(torch_sets.count)]
        turn = [0]

        def next_jax():
            turn[0] = (turn[0] + 1) % len(jax_sets)
            return jax_sets[turn[0]]

        for family in plan.jax_families:
            compiled = {}
            for mode, jitted in zip(("fwd", "fwdbwd"), _jax_ops(family)):
                ins = (lambda: next_jax()[:4]) if mode == "fwd" else next_jax
                row = dict(impl=f"ours {family} (jax)", launch="jax", family=family, T=size[1],
                           mode=mode, xla_bytes=None)
                synced = dict(impl=f"ours {family} (torch, synced)", launch="torch-synced",
                              family=family, T=size[1], mode=mode)
                try:  # compiled once, ahead of time: what is timed, and its memory plan
                    compiled[mode] = jitted.lower(*ins()).compile()
                except Exception as e:
                    emit("row", **row, ms=None, **failure(e))
                    emit("row", **synced, ms=None, status="not_reached",
                         error="its JAX twin did not compile")
                    continue
                try:
                    mem = compiled[mode].memory_analysis()
                    row["xla_bytes"] = int(mem.temp_size_in_bytes + mem.output_size_in_bytes)
                except Exception:  # no plan on this backend: the column says "-"
                    pass

                def call(run=compiled[mode], ins=ins):
                    args = ins()
                    sync()
                    return jax.block_until_ready(run(*args))
                _measure(emit, plan, deadline, row, call, size, mode, peak=False)
                _measure(emit, plan, deadline, synced,
                         _torch_fn(_ours(family), torch_sets, mode, sync=not plan.dry),
                         size, mode, peak=False)
            if "fwd" in compiled and not _late(deadline):  # one kernel, two launchers
                q, k, v, g, _ = torch_sets()
                try:
                    with torch.no_grad():
                        want = _ours(family)(q, k, v, g).float().cpu().numpy()
                    got = compiled["fwd"](*[jax.dlpack.from_dlpack(x.detach())
                                            for x in (q, k, v, g)])
                    emit("agree", family=family, T=size[1],
                         jax_vs_torch=rel_err(np.asarray(got.astype(jnp.float32)), want))
                except Exception as e:
                    emit("agree", family=family, T=size[1], jax_vs_torch=None,
                         error=f"{type(e).__name__}: {str(e)[:300]}")
        jax_sets.clear()  # frees the arrays now; next_jax's closure still names the list
        del torch_sets
    return {}

