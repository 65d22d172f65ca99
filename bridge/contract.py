"""The argument contract of every op in SPEC.md, written once for every backend.

`check(...)` reads only shapes, dtypes, devices and (where they are on the host)
`cu_seqlens` values, so it serves torch tensors, jax arrays (traced or not) and
numpy arrays alike. It raises `ValueError`/`TypeError` naming the argument, the
expected and the actual shape or value, and returns a frozen `Plan` that the
launchers use instead of re-deriving sizes.

Offsets on a GPU or TPU are never read on the host (a read would stall the
host until the device catches up, once per call): torch tensors on a GPU are
checked on the device, asynchronously (`torch._assert_async`: a bad value fails
the next synchronizing call with a device-side assert, before any kernel queued
after the check has run), and concrete JAX arrays on a GPU or TPU go unchecked,
as traced ones do. `GLA_BRIDGE_HOST_CHECKS=1` in the environment, or the
`host_checks()` context, reads them on the host instead, raising the
`ValueError`s below (one sync per call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
from dataclasses import dataclass

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int32", "int64", "int16", "int8", "uint8", "uint16", "uint32", "uint64")
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}

# The names of a call's arrays, for every layer (SPEC.md's argument names).
INPUTS = ("q", "k", "v", "g", "gk", "gv", "g_gamma", "initial_state")  # differentiable, in
# the launchers' order (the public signature's order differs: g_gamma before gk)
ARGS = (*INPUTS, "cu_seqlens")  # the array arguments of the ops, in the launchers' order
TOKENS = ("q", "k", "v", "g", "gk", "gv")  # the inputs with a time axis: [B,T,H,*]
# every array of a call laid out [B,T,H,*] (packed: [total,H,*]): the inputs with a time
# axis, the output o, its cotangent do, and the chunked forward's intra-chunk matrix A
# [B,T,H,BT] (which autograd keeps for the backward, bridge.kernels.chunk.kept)
PER_TOKEN = (*TOKENS, "o", "do", "A")
PER_SEQUENCE = ("initial_state", "final_state", "dfinal_state")  # [N,H,K,V], one per sequence


def nbytes(shape, dtype: str) -> int:
    """Bytes of an array of `shape` and dtype name `dtype` ('float32', ...)."""
    n = ITEMSIZE[dtype]
    for s in shape:
        n *= int(s)
    return n


@dataclass(frozen=True)
class Plan:
    """Sizes and switches of one call, normalised to the batched layout.

    With `varlen`, B == 1, T is the packed token count and N the number of
    sequences; without it N == B. `packed` says the inputs came as [total, H, *]
    (the launchers view them as [1, total, H, *] and give `o` back packed).
    `g` is "none", "head" ([B,T,H], one scalar per head and step) or "key"
    ([B,T,H,K]); `g_gamma` is "none", "head" ([H]) or "seq" ([N,H]).
    """

    B: int
    T: int
    H: int
    Hk: int
    K: int
    V: int
    N: int
    g: str
    gk: bool
    gv: bool
    g_gamma: str
    initial_state: bool
    scale: float
    reverse: bool
    varlen: bool
    packed: bool
    dtype: str

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.H // self.Hk

    @classmethod
    def of_batched(cls, arrays: dict, cu_seqlens=None, *, scale: float,
                   reverse: bool) -> "Plan":
        """The Plan of arguments already checked (`check`) and in the batched layout:
        `arrays` the arrays of `INPUTS` by name (absent ones None or left out), q
        [B,T,H,K]. Reads shapes and ndim only (any framework, traced or not); the gate
        kinds follow from ndim (g [B,T,H] or [B,T,H,K], g_gamma [H] or [N,H]). `packed`
        is False: the arrays are batched already."""
        q, k, v = arrays["q"], arrays["k"], arrays["v"]
        g, g_gamma = arrays.get("g"), arrays.get("g_gamma")
        # sizes as the framework gives them: symbolic under torch.compile's dynamic shapes
        B, T, H, K = q.shape
        return cls(B=B, T=T, H=H, Hk=k.shape[2], K=K, V=v.shape[3],
                   N=B if cu_seqlens is None else cu_seqlens.shape[0] - 1,
                   g="none" if g is None else "head" if len(g.shape) == 3 else "key",
                   gk=arrays.get("gk") is not None, gv=arrays.get("gv") is not None,
                   g_gamma="none" if g_gamma is None else "head" if len(g_gamma.shape) == 1
                   else "seq", initial_state=arrays.get("initial_state") is not None,
                   scale=scale, reverse=reverse, varlen=cu_seqlens is not None, packed=False,
                   dtype=dtype_name(q))

    def folded(self, n: int, gamma_per_sequence: bool = True) -> "Plan":
        """The Plan of n such problems run as one (a vmapped axis of size n): folded
        into the batch, [n, B, T, ...] -> [n*B, T, ...]; with cu_seqlens (B == 1) into
        the packed tokens, [n, 1, T, ...] -> [1, n*T, ...] (n*N sequences either way).
        A g_gamma [H] becomes one row per folded sequence [n*N, H] unless
        `gamma_per_sequence` is False (one [H] shared by every problem)."""
        size = dict(T=n * self.T) if self.varlen else dict(B=n * self.B)
        gamma = "seq" if self.g_gamma != "none" and gamma_per_sequence else self.g_gamma
        return dataclasses.replace(self, N=n * self.N, g_gamma=gamma, **size)

    def inputs(self) -> tuple:
        """The names of `INPUTS` this call was given, in that order."""
        given = dict(g=self.g != "none", gk=self.gk, gv=self.gv,
                     g_gamma=self.g_gamma != "none", initial_state=self.initial_state)
        return tuple(n for n in INPUTS if given.get(n, True))

    def shape(self, name: str) -> tuple:
        """Shape of one of the call's tensors in the batched layout: an input (of
        `INPUTS`, as given), cu_seqlens, the outputs o and final_state, or their
        cotangents do and dfinal_state. An input's gradient has the input's shape."""
        B, T, H, Hk, K, V, N = self.B, self.T, self.H, self.Hk, self.K, self.V, self.N
        if name == "g":
            return (B, T, H, K) if self.g == "key" else (B, T, H)
        if name == "g_gamma":
            return (H,) if self.g_gamma == "head" else (N, H)
        shapes = {"q": (B, T, H, K), "k": (B, T, Hk, K), "v": (B, T, Hk, V),
                  "gk": (B, T, H, K), "gv": (B, T, H, V), "cu_seqlens": (N + 1,),
                  "o": (B, T, H, V), "do": (B, T, H, V)}
        if name in PER_SEQUENCE:
            return (N, H, K, V)
        if name not in shapes:
            raise ValueError(f"name: expected a tensor of the call ({', '.join(ARGS)}, o, "
                             f"final_state, do, dfinal_state), got {name!r}")
        return shapes[name]

    def tensor_dtype(self, name: str) -> str:
        """The dtype the launch plans assume for one of the call's tensors: q, k, v,
        the gates, o and do in the plan's dtype; g_gamma (a per-head constant) and the
        states float32; cu_seqlens int32."""
        self.shape(name)  # an unknown name is an error
        if name == "cu_seqlens":
            return "int32"
        if name == "g_gamma" or name in PER_SEQUENCE:
            return "float32"
        return self.dtype

    def nbytes(self, name: str) -> int:
        """Bytes of one of the call's tensors (`shape`, `tensor_dtype`)."""
        return nbytes(self.shape(name), self.tensor_dtype(name))

    def outputs(self) -> dict:
        """{name: (shape, dtype)} of the forward's results, o and final_state."""
        return {n: (self.shape(n), self.tensor_dtype(n)) for n in ("o", "final_state")}

    def gradients(self) -> dict:
        """{input: (shape, dtype)} of the gradients the backward returns: one per given
        input, in its shape and dtype."""
        return {n: (self.shape(n), self.tensor_dtype(n)) for n in self.inputs()}


def dtype_name(x) -> str:
    """'float32', 'bfloat16', ... for torch, numpy and jax arrays alike."""
    return str(x.dtype).replace("torch.", "")


class ShapeOnly:
    """An array whose values this check must not read: a torch tensor traced by
    torch.compile or a torch.func transform, or offsets another check covers. It keeps
    the shape, dtype, device and framework; `known_values` gives None, as for a JAX
    tracer (SPEC: cu_seqlens values are checked when known)."""

    def __init__(self, x):
        self.shape, self.dtype = tuple(x.shape), x.dtype
        self.device, self.framework = _device(x), _framework(x)


_TORCH_TYPES: dict = {}  # type -> whether it is torch's (`_is_torch` asks once a type)


def _is_torch(x) -> bool:
    """Whether x is a torch tensor (of torch's own types or a subclass of them)."""
    t = type(x)
    torchy = _TORCH_TYPES.get(t)
    if torchy is None:
        torchy = _TORCH_TYPES[t] = any(c.__module__ == "torch" or c.__module__.startswith("torch.")
                                       for c in t.__mro__[:-1])
    return torchy


def _device(x):
    """A comparable device label, or None where none applies (numpy) or can be known (tracers)."""
    if isinstance(x, ShapeOnly):
        return x.device
    if isinstance(x, np.ndarray):
        return None
    if _is_torch(x):
        return str(x.device)
    try:  # concrete jax array
        return ",".join(sorted(str(d) for d in x.devices()))
    except Exception:
        return None


def _framework(x) -> str:
    """'torch', 'numpy' or 'jax' (anything else with a shape and dtype counts as jax)."""
    if isinstance(x, ShapeOnly):
        return x.framework
    if isinstance(x, np.ndarray):
        return "numpy"
    return "torch" if _is_torch(x) else "jax"


_HOST_CHECKS = [os.environ.get("GLA_BRIDGE_HOST_CHECKS", "0") == "1"]


@contextlib.contextmanager
def host_checks(on: bool = True):
    """Within it, offsets on a GPU or TPU are read on the host and checked there (a
    device sync per call, for the contract's exact ValueErrors); GLA_BRIDGE_HOST_CHECKS=1
    in the environment is the same for the whole process."""
    was = _HOST_CHECKS[0]
    _HOST_CHECKS[0] = on
    try:
        yield
    finally:
        _HOST_CHECKS[0] = was


def on_device(x) -> bool:
    """Whether x's values live on a GPU or TPU, where reading them on the host waits for
    the device: a torch tensor on CUDA (or ROCm), a concrete JAX array on a GPU or TPU."""
    if isinstance(x, (ShapeOnly, np.ndarray)):
        return False
    if _is_torch(x):
        return x.device.type == "cuda"
    try:
        return any(d.platform != "cpu" for d in x.devices())
    except Exception:  # a tracer, or not a JAX array
        return False


def known_values(x):
    """The values of `x` as a numpy array, or None while they are traced or, unless
    `host_checks` is on, live on a GPU or TPU (`on_device`)."""
    if isinstance(x, ShapeOnly) or (on_device(x) and not _HOST_CHECKS[0]):
        return None
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except Exception:
        return None


def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def _fmt(names, sizes) -> str:
    return "[" + ", ".join(n if s is None else f"{n}={s}" for n, s in zip(names, sizes)) + "]"


def _expect_shape(name, x, names, sizes):
    """Raise unless x.shape == sizes (None entries match anything)."""
    shape = _shape(x)
    ok = len(shape) == len(sizes) and all(s is None or s == a for s, a in zip(sizes, shape))
    if not ok:
        raise ValueError(f"{name}: expected shape {_fmt(names, sizes)}, got {shape}")


def _expect_float(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array or tensor, got {type(x).__name__}")
    dt = dtype_name(x)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype ({', '.join(FLOAT_DTYPES)}), got {dt}")


_PLANS: dict = {}  # signature -> Plan of arguments that passed (see check)
_PLANS_MAX = 256


def _signature(x):
    """What `check` reads of a given array besides cu_seqlens values: its type, shape, dtype
    and device (torch's own device object: cheaper than its label)."""
    t = type(x)
    if _is_torch(x):  # a symbolic size refuses to hash
        return t, x.shape, x.dtype, x.device
    shape = tuple(x.shape)
    if not all(type(s) is int for s in shape):  # symbolic (jax.export): no memo
        raise TypeError("symbolic shape")
    return t, shape, x.dtype, _device(x)


def check(q, k, v, *, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
          initial_state=None, reverse=False, cu_seqlens=None, memo=True) -> Plan:
    """Validate the arguments of `recurrent` (SPEC.md) and return their Plan (every
    argument after v by name: the public order and the launchers' differ).

    Without cu_seqlens the Plan depends only on each array's `_signature` and the two
    scalars, so with `memo` arguments that passed once are not checked again (a decoding
    step's check would cost as much as its recurrence); anything new, or that fails, runs
    the full check every time. memo=False while torch.compile traces the call: hashing a
    shape there would specialize it."""
    if cu_seqlens is not None or not memo:
        return _check(q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse,
                      cu_seqlens)
    try:
        key = (*[None if x is None else _signature(x)
                 for x in (q, k, v, g, g_gamma, gk, gv, initial_state)],
               type(softmax_scale), softmax_scale, type(reverse), reverse)
        plan = _PLANS.get(key)
    except Exception:  # not an array, or unhashable: the full check says what is wrong
        key = plan = None
    if plan is None:
        plan = _check(q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, None)
        if key is not None:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _check(q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse,
           cu_seqlens) -> Plan:
    arrays = {"q": q, "k": k, "v": v, "g": g, "g_gamma": g_gamma, "gk": gk, "gv": gv,
              "initial_state": initial_state}
    for name, x in arrays.items():
        if x is not None:
            _expect_float(name, x)

    varlen = cu_seqlens is not None
    packed = varlen and len(q.shape) == 3
    if packed:
        lead_names = ["total"]
    elif len(q.shape) == 4:
        lead_names = ["B", "T"]
    elif varlen:
        raise ValueError(f"q: expected shape [B, T, H, K] or packed [total, H, K], got {_shape(q)}")
    else:
        raise ValueError(f"q: expected shape [B, T, H, K] (packed [total, H, K] needs cu_seqlens), "
                         f"got {_shape(q)}")
    lead = _shape(q)[:-2]
    H, K = _shape(q)[-2:]
    B, T = (1, lead[0]) if packed else lead
    if H < 1 or K < 1:
        raise ValueError(f"q: expected H >= 1 and K >= 1, got shape {_shape(q)}")

    _expect_shape("k", k, lead_names + ["Hk", "K"], list(lead) + [None, K])
    Hk = _shape(k)[-2]
    if Hk < 1 or H % Hk != 0:
        raise ValueError(f"k: expected a kv head count Hk dividing H={H}, got Hk={Hk}")
    _expect_shape("v", v, lead_names + ["Hk", "V"], list(lead) + [Hk, None])
    V = _shape(v)[-1]
    if V < 1:
        raise ValueError(f"v: expected V >= 1, got shape {_shape(v)}")

    N = B
    if varlen:
        if B != 1:
            check_offsets(cu_seqlens, None)  # its own type errors come first
            raise ValueError(f"cu_seqlens: expected batch size B=1 with cu_seqlens, got B={B} "
                             f"(q shape {_shape(q)})")
        N = check_offsets(cu_seqlens, T)

    g_kind = "none"
    if g is not None:
        if len(g.shape) == len(q.shape) - 1:
            g_kind = "head"
            _expect_shape("g", g, lead_names + ["H"], list(lead) + [H])
        else:
            g_kind = "key"
            _expect_shape("g", g, lead_names + ["H", "K"], list(lead) + [H, K])
    if gk is not None:
        _expect_shape("gk", gk, lead_names + ["H", "K"], list(lead) + [H, K])
    if gv is not None:
        _expect_shape("gv", gv, lead_names + ["H", "V"], list(lead) + [H, V])

    gamma_kind = "none"
    if g_gamma is not None:
        if len(g_gamma.shape) == 1:
            gamma_kind = "head"
            _expect_shape("g_gamma", g_gamma, ["H"], [H])
        else:
            gamma_kind = "seq"
            _expect_shape("g_gamma", g_gamma, ["N", "H"], [N, H])
    if initial_state is not None:
        _expect_shape("initial_state", initial_state, ["N", "H", "K", "V"], [N, H, K, V])

    scale = _check_scale(softmax_scale, K)
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(f"reverse: expected a bool, got {type(reverse).__name__}")

    # torch tensors mix with nothing else (the torch ops call tensor methods on
    # every input); jax arrays mix with numpy arrays (jnp.asarray takes them)
    given = {n: x for n, x in dict(arrays, cu_seqlens=cu_seqlens).items() if x is not None}
    kinds = {n: _framework(x) for n, x in given.items()}
    if "torch" in kinds.values() and len(set(kinds.values())) > 1:
        odd = next(n for n, f in kinds.items() if f != kinds["q"])
        raise TypeError(f"{odd}: expected a {kinds['q']} array like q (torch tensors do not mix "
                        f"with numpy or jax arrays), got {type(given[odd]).__module__}."
                        f"{type(given[odd]).__name__}")

    devices = {}
    for name, x in dict(arrays, cu_seqlens=cu_seqlens).items():
        d = None if x is None else _device(x)
        if d is not None:
            devices.setdefault(d, name)
    if len(devices) > 1:
        where = ", ".join(f"{n} on {d}" for d, n in devices.items())
        raise ValueError(f"{list(devices.values())[-1]}: expected every tensor on one device, "
                         f"got {where}")

    return Plan(B=B, T=T, H=H, Hk=Hk, K=K, V=V, N=N, g=g_kind, gk=gk is not None,
                gv=gv is not None, g_gamma=gamma_kind, initial_state=initial_state is not None,
                scale=scale, reverse=bool(reverse), varlen=varlen, packed=packed,
                dtype=dtype_name(q))


_OFFSET_ERRORS = ("cu_seqlens: expected to start at 0",
                  "cu_seqlens: expected non-decreasing values",
                  "cu_seqlens: expected to end at the token count {total}")


def check_offsets(cu_seqlens, total) -> int:
    """Validate packed-sequence offsets [N + 1] (integer, starting at 0, non-decreasing,
    ending at `total` tokens; values only where known, ends not checked for total None)
    and return N. Torch offsets on a GPU are checked on the device (module doc)."""
    if not hasattr(cu_seqlens, "shape") or not hasattr(cu_seqlens, "dtype"):
        raise TypeError(f"cu_seqlens: expected a 1-d integer array or tensor, "
                        f"got {type(cu_seqlens).__name__}")
    if dtype_name(cu_seqlens) not in INT_DTYPES:
        raise TypeError(f"cu_seqlens: expected an integer dtype, got {dtype_name(cu_seqlens)}")
    if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape [N + 1] with N >= 1, "
                         f"got {_shape(cu_seqlens)}")
    if total is None:
        return int(cu_seqlens.shape[0]) - 1
    cu = known_values(cu_seqlens)
    if cu is not None:
        start, order, end = _OFFSET_ERRORS
        if cu[0] != 0:
            raise ValueError(f"{start}, got cu_seqlens[0]={int(cu[0])}")
        steps = np.diff(cu.astype(np.int64))
        if (steps < 0).any():
            i = int(np.argmax(steps < 0))
            raise ValueError(f"{order}, got "
                             f"cu_seqlens[{i}]={int(cu[i])} > cu_seqlens[{i + 1}]={int(cu[i + 1])}")
        if cu[-1] != total:
            raise ValueError(f"{end.format(total=total)}, got cu_seqlens[-1]={int(cu[-1])}")
    elif _is_torch(cu_seqlens) and on_device(cu_seqlens):
        _assert_on_device(cu_seqlens.detach(), total)
    return int(cu_seqlens.shape[0]) - 1


def _assert_on_device(cu, total):
    """The value checks of `check_offsets` queued on cu's device, without waiting for it:
    a failure surfaces at the next synchronizing call (a device-side assert on CUDA; the
    messages reach the host only where the device can raise them)."""
    import torch

    start, order, end = _OFFSET_ERRORS
    torch._assert_async(cu[0] == 0, start)
    torch._assert_async((cu[1:] >= cu[:-1]).all(), order)
    torch._assert_async(cu[-1] == total, end.format(total=total))


def _check_scale(softmax_scale, K) -> float:
    if softmax_scale is None:
        return float(K) ** -0.5
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError("softmax_scale: expected a Python float, got "
                        f"{type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not np.isfinite(scale):
        raise ValueError(f"softmax_scale: expected a finite number, got {scale}")
    return scale
