"""Every implementation the benchmark compares, behind one interface.

`Impl.build(arrays)` takes float32 NumPy inputs q,k [B,T,H,K], v [B,T,H,V],
g [B,T,H,K] (log-space gates <= 0) and do [B,T,H,V], moves them into the
implementation's framework once, and returns two closures that run to
completion (JAX results are blocked on):
    fwd()    -> o [B,T,H,V]
    fwdbwd() -> {"q","k","v","g": gradients of sum(o * do)}
`Impl.missing()` says why the implementation cannot run here (None when it can):
an anchor that is not installed is reported, never a crash.
"""

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

GRAD_NAMES = ("q", "k", "v", "g")


@dataclass
class Impl:
    name: str          # row label in the tables
    framework: str     # "torch" or "jax": which ratio group it belongs to
    build: Callable    # arrays -> (fwd, fwdbwd)
    requires: tuple = ()  # importable module names it needs
    note: str = ""     # one line for the report
    limit: Optional[Callable] = field(default=None)  # (B,T,H,K,V) -> reason to skip, or None
    budgeted: bool = True  # anchors stop growing T past the time budget; our own paths do not

    def missing(self) -> Optional[str]:
        for mod in self.requires:
            if importlib.util.find_spec(mod) is None:
                return f"not installed ({mod})"
        return None


# ---------------------------------------------------------------- torch side

def _torch_build(op):
    """fwd under no_grad (inference forward); fwdbwd through torch.autograd."""
    def build(a):
        import torch

        ins = [torch.from_numpy(a[n]) for n in GRAD_NAMES]
        do = torch.from_numpy(a["do"])

        def fwd():
            with torch.no_grad():
                return op(*ins)

        def fwdbwd():
            leaves = [x.detach().requires_grad_(True) for x in ins]
            grads = torch.autograd.grad(op(*leaves), leaves, grad_outputs=do)
            return dict(zip(GRAD_NAMES, grads))
        return fwd, fwdbwd
    return build


def _torch_native(q, k, v, g):
    import torch_side

    return torch_side.recurrent_gla(q, k, v, g, platform="torch")[0]


def load_fla_naive():
    """flash-linear-attention's pure-torch reference, loaded by file path: importing
    the `fla` package itself needs triton kernels that do not load on CPU.
    find_spec("fla") locates the package without importing it."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("flash-linear-attention (fla-core) is not installed")
    import os

    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "gla", "naive.py")
    mod_spec = importlib.util.spec_from_file_location("_bench_fla_gla_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.naive_recurrent_gla


def _fla_naive(q, k, v, g):
    # Layout [B,T,H,*] like ours; fixed scale K**-0.5, the same as our default.
    return _fla_naive.fn(q, k, v, g)[0]


def _fla_build(a):
    _fla_naive.fn = load_fla_naive()
    return _torch_build(_fla_naive)(a)


# ---------------------------------------------------------------- JAX side

_JAX_FNS = {}


def _jax_fns(op, jit):
    """One (fwd, grad) pair per op, so repeated builds at one shape reuse the compilation."""
    if (op, jit) not in _JAX_FNS:
        import jax
        import jax.numpy as jnp

        loss = lambda q, k, v, g, do: jnp.sum(op(q, k, v, g) * do)  # noqa: E731
        f, df = op, jax.grad(loss, argnums=(0, 1, 2, 3))
        _JAX_FNS[op, jit] = (jax.jit(f), jax.jit(df)) if jit else (f, df)
    return _JAX_FNS[op, jit]


def _jax_build(op, jit=True):
    """op(q,k,v,g) -> o, jitted; fwdbwd = jit(grad of sum(o * do)). jit=False
    runs both eagerly (for code that cannot be traced as a whole)."""
    def build(a):
        import jax
        import jax.numpy as jnp

        ins = [jnp.asarray(a[n]) for n in GRAD_NAMES]
        do = jnp.asarray(a["do"])
        f, df = _jax_fns(op, jit)

        def fwd():
            return jax.block_until_ready(f(*ins))

        def fwdbwd():
            return dict(zip(GRAD_NAMES, jax.block_until_ready(df(*ins, do))))
        return fwd, fwdbwd
    return build


def _jax_xla(q, k, v, g):
    import jax_side

    return jax_side.recurrent_gla(q, k, v, g, platform="xla")[0]


def lax_scan_gla(q, k, v, g):
    """The plain recurrence: one lax.scan step per token over a [B,H,K,V] state,
    S = exp(g_t)[:, None] * S + k_t^T v_t, o_t = scale q_t S (differentiated by jax.grad)."""
    import jax
    import jax.numpy as jnp

    B, T, H, K = q.shape
    scale = K ** -0.5

    def step(S, x):
        qt, kt, vt, gt = x  # [B,H,K], [B,H,K], [B,H,V], [B,H,K]
        S = jnp.exp(gt)[..., None] * S + kt[..., :, None] * vt[..., None, :]
        return S, jnp.einsum("bhk,bhkv->bhv", qt * scale, S)

    S0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
    _, o = jax.lax.scan(step, S0, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g)))
    return jnp.moveaxis(o, 0, 1)


def _ejkernel_default(q, k, v, g):
    from ejkernel.kernels._xla.gla._interface import recurrent_gla

    return recurrent_gla(q, k, v, g=g)[0]


def _ejkernel_packed(q, k, v, g):
    """ejkernel's packed variable-length path: B sequences of T tokens as one
    [1,B*T,H,*] stream. cu_seqlens is a NumPy constant, concrete at trace time
    (its backward needs that)."""
    from ejkernel.kernels._xla.recurrent._interface import recurrent

    B, T, H, K = q.shape
    import jax.numpy as jnp

    cu = jnp.asarray(np.arange(B + 1, dtype=np.int32) * T)
    flat = [x.reshape(1, B * T, H, x.shape[-1]) for x in (q, k, v, g)]
    o = recurrent(flat[0], flat[1], flat[2], g=flat[3], cu_seqlens=cu)[0]
    return o.reshape(B, T, H, v.shape[-1])


# Per-step paths keep every step's [H,K,V] state for the backward (ejkernel's packed
# path; lax.scan under autodiff), and peak use is a few times that: at 2 GiB of
# history (T=8192 here) the run was killed for memory on a 24 GiB machine.
HISTORY_LIMIT_BYTES = 3 * 2 ** 29


def _history_limit(B, T, H, K, V):
    """Skip a per-step path whose fp32 state history would not fit this machine."""
    need = 4 * B * T * H * K * V
    if need > HISTORY_LIMIT_BYTES:
        return (f"skipped: its per-step state history would need {need / 2**30:.1f} GiB "
                f"(limit {HISTORY_LIMIT_BYTES / 2**30:.1f} GiB; out of memory here)")
    return None


def cpu_impls() -> list:
    """The CPU comparison, baseline first in each framework."""
    return [
        Impl("torch-native", "torch", _torch_build(_torch_native), budgeted=False,
             note="torch_side.recurrent_gla(platform='torch'): our chunked torch path"),
        Impl("fla naive", "torch", _fla_build, requires=("fla",),
             note="fla/ops/gla/naive.py naive_recurrent_gla (loaded by file path), a per-step "
                  "torch loop"),
        Impl("jax-xla", "jax", _jax_build(_jax_xla), budgeted=False,
             note="jax_side.recurrent_gla(platform='xla'): our chunked XLA path"),
        Impl("ejkernel XLA", "jax", _jax_build(_ejkernel_default), requires=("ejkernel",),
             note="ejkernel 0.0.80.3 recurrent_gla (XLA), default batched path"),
        Impl("ejkernel XLA packed", "jax", _jax_build(_ejkernel_packed, jit=False),
             requires=("ejkernel",),
             limit=_history_limit,
             note="ejkernel recurrent (XLA) on the packed cu_seqlens path, which "
                  "differentiates (eager: not jittable with cu_seqlens)"),
        Impl("lax.scan", "jax", _jax_build(lax_scan_gla), limit=_history_limit,
             note="a plain per-step jax.lax.scan recurrence (this module), jax.grad through it"),
    ]


# Which anchor each of ours is compared with (ratio = anchor time / our time).
BASELINES = {"torch": "torch-native", "jax": "jax-xla"}
