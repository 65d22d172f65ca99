"""Test and parity cases: what a case is, and its inputs, generated once in NumPy.

A `Case` names the SPEC features it exercises; `inputs(case, seed)` returns
float32 NumPy arrays (rounding to a lower dtype happens where the arrays are
handed to a framework, and the oracle sees the rounded values). Every test
draws its `recurrent` inputs here: `make(seed, **fields)` for a case given by
keywords, `split` / `cast` / `to_torch` / `to_jax` to hand them on.
"""

from dataclasses import dataclass, replace

import numpy as np

from bridge.contract import INPUTS, PER_TOKEN  # INPUTS: the differentiable inputs, in order

ACTIVATIONS = ("q", "k", "v", "do")  # given in the tested dtype; gates and states stay fp32
COTANGENTS = ("do", "dfinal_state")


@dataclass(frozen=True)
class Case:
    name: str = "case"
    B: int = 1
    T: int = 12
    H: int = 2
    Hk: int = 2
    K: int = 8
    V: int = 8
    g: str = "none"         # "none" | "head" ([B,T,H]) | "key" ([B,T,H,K])
    gk: bool = False
    gv: bool = False
    g_gamma: str = "none"   # "none" | "head" ([H]) | "seq" ([N,H])
    initial_state: bool = False
    reverse: bool = False
    seqlens: tuple = None   # packed variable-length sequences (B must be 1)
    packed: bool = False    # give packed inputs as [total, H, *] rather than [1, total, H, *]
    # log gates: -uniform(*gate_range) * gate_scale a step;
    # g_gamma -uniform(*gamma_range) * gate_scale
    gate_scale: float = 1.0
    gate_range: tuple = (0.02, 1.0)  # (5, 10): every step decays by e^-5 or more
    gamma_range: tuple = (0.02, 0.5)
    softmax_scale: float = None
    # Gate gradients come from the cumulative identity da_r = da_{r+1} + q.dq' - k.dk',
    # whose fp32 rounding is absolute: about epsilon times the O(1) q.dq terms. When
    # strong decays make the true gate gradient tiny (RMS 3e-4 where moderate decays
    # give 0.2-1.4, measured on these cases), its relative error says nothing, so
    # such cases measure it against this RMS floor: a tenth of the moderate scale.
    gate_grad_floor: float = 0.0

    def __post_init__(self):
        if self.seqlens is not None and self.B != 1:
            raise ValueError(f"{self.name}: packed sequences (seqlens) need B == 1, got {self.B}")

    @property
    def N(self):
        return len(self.seqlens) if self.seqlens else self.B

    def with_(self, **kw):
        return replace(self, **kw)


def inputs(case: Case, seed: int = 0) -> dict:
    """Arguments of `recurrent` for this case (float32 NumPy, int32 cu_seqlens),
    plus the cotangents `do` and `dfinal_state`: q [B,T,H,K], k [B,T,Hk,K],
    v [B,T,Hk,V], do [B,T,H,V] (packed: [total,H,*]), gates in their SPEC shapes,
    initial_state and dfinal_state [N,H,K,V], cu_seqlens [N+1]."""
    rng = np.random.default_rng(seed)
    T = sum(case.seqlens) if case.seqlens else case.T
    lead = (T,) if case.packed else (case.B, T)
    H, Hk, K, V, N = case.H, case.Hk, case.K, case.V, case.N

    def normal(*shape, s=1.0):
        return (rng.standard_normal(lead + shape) * s).astype(np.float32)

    def gate(*shape):
        return (-rng.uniform(*case.gate_range, lead + shape) * case.gate_scale).astype(np.float32)

    out = dict(q=normal(H, K), k=normal(Hk, K), v=normal(Hk, V), do=normal(H, V),
               dfinal_state=rng.standard_normal((N, H, K, V)).astype(np.float32))
    if case.g == "head":
        out["g"] = gate(H)
    elif case.g == "key":
        out["g"] = gate(H, K)
    if case.gk:
        out["gk"] = gate(H, K)
    if case.gv:
        out["gv"] = gate(H, V)
    if case.g_gamma != "none":
        shape = (H,) if case.g_gamma == "head" else (N, H)
        out["g_gamma"] = (-rng.uniform(*case.gamma_range, shape) * case.gate_scale
                          ).astype(np.float32)
    if case.initial_state:
        out["initial_state"] = rng.standard_normal((N, H, K, V)).astype(np.float32)
    if case.seqlens:
        out["cu_seqlens"] = np.concatenate([[0], np.cumsum(case.seqlens)]).astype(np.int32)
    return out


def make(seed: int = 0, **fields) -> tuple:
    """(Case(**fields), inputs(case, seed)): a case given by its fields, e.g.
    make(T=150, H=4, Hk=2, g="key", initial_state=True, seqlens=(0, 70, 80))."""
    case = Case(**fields)
    return case, inputs(case, seed)


def split(arrays: dict) -> tuple:
    """(the arrays `recurrent` takes, {do, dfinal_state})."""
    return ({n: a for n, a in arrays.items() if n not in COTANGENTS},
            {n: arrays[n] for n in COTANGENTS if n in arrays})


def cast(arrays: dict, dtype=np.float64) -> dict:
    """Every floating array in NumPy `dtype` (cu_seqlens stays int32)."""
    return {n: a if n == "cu_seqlens" else np.asarray(a, dtype) for n, a in arrays.items()}


def to_torch(arrays: dict, dtype=None, requires_grad: bool = False) -> dict:
    """torch tensors on the CPU: the activations (q, k, v, do) in `dtype` (a torch
    dtype; None keeps them), the rest as given; with requires_grad the
    differentiable inputs (`INPUTS`) are leaves that record gradients."""
    import torch

    out = {}
    for n, a in arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(a))
        if dtype is not None and n in ACTIVATIONS:
            t = t.to(dtype)
        out[n] = t.requires_grad_(requires_grad and n in INPUTS)
    return out


def launch_env(case, arrays: dict, dtype: str):
    """(plan, env, t) for running a launch list directly: `t = to_torch(arrays, dtype)`,
    the case's checked Plan, and the {name: tensor} a launch list reads (a packed call's
    per-token inputs with their batch axis of 1, cu_seqlens in int32)."""
    import torch

    from bridge import contract

    t = to_torch(arrays, getattr(torch, dtype))
    plan = contract.check(**call_kwargs(case, t))
    env = {n: (x.reshape((1,) + tuple(x.shape)) if plan.packed and n in PER_TOKEN else x)
           for n, x in t.items()}
    if plan.varlen:
        env["cu_seqlens"] = env["cu_seqlens"].to(torch.int32)
    return plan, env, t


def to_jax(arrays: dict, dtype=None) -> dict:
    """jax arrays: the activations (q, k, v, do) in `dtype` (None keeps them), the
    rest as given."""
    import jax.numpy as jnp

    return {n: jnp.asarray(a, dtype if dtype is not None and n in ACTIVATIONS else None)
            for n, a in arrays.items()}


def call_kwargs(case: Case, arrays: dict) -> dict:
    """The keyword arguments of `recurrent` from a dict holding the arrays."""
    kw = {n: arrays[n] for n in (*INPUTS, "cu_seqlens") if arrays.get(n) is not None}
    kw.update(reverse=case.reverse, softmax_scale=case.softmax_scale)
    return kw


# Each SPEC feature alone, then combined; tiny enough for the Triton interpreter.
FEATURES = [
    Case("plain"),
    Case("g-head", g="head"),
    Case("g-key", g="key"),
    Case("gk", gk=True),
    Case("gv", gv=True),
    Case("gamma-head", g_gamma="head"),
    Case("gamma-seq", B=2, H=1, Hk=1, g_gamma="seq"),
    Case("initial-state", B=2, H=1, Hk=1, initial_state=True),
    Case("reverse", g="key", reverse=True),
    Case("varlen", H=1, Hk=1, seqlens=(5, 0, 9, 3), g="key", initial_state=True, packed=True),
    Case("varlen-batched-form", H=1, Hk=1, seqlens=(4, 7), gv=True),
    Case("gqa", H=4, Hk=1, K=6, V=10, g="head"),
    Case("odd-kv", H=1, Hk=1, K=33, V=40, gk=True, gv=True, initial_state=True),
    Case("scale", g="head", softmax_scale=0.3),
    Case("everything", H=2, Hk=1, K=5, V=7, g="key", gk=True, gv=True, g_gamma="seq",
         initial_state=True, reverse=True, seqlens=(6, 1, 0, 8), packed=True),
    Case("strong-gates", g="key", gv=True, gate_scale=40.0, initial_state=True,
         gate_grad_floor=0.1),
]
