"""Framework-neutral description of kernel launches.

A kernel module turns a `Plan` into a list of `Launch`es; each framework runs
the list with its own executor (torch: direct Triton launch; JAX: jax-triton
or a host callback). Every launch reads named tensors (user inputs or outputs
of earlier launches) and writes named outputs, so the sequence of kernels and
the sizes of every buffer are written once, here in `bridge`.

Arguments are bound by kernel parameter name and checked against the kernel's
own parameter list when the Launch is built, so a reordered or renamed kernel
parameter is an error there, never a shifted argument.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from .contract import nbytes


@dataclass(frozen=True)
class Out:
    """An output buffer: its name, shape and dtype name ('float32', or 'like:q')."""

    name: str
    shape: tuple
    dtype: str = "float32"

    def nbytes(self, plan) -> int:
        """Its size in bytes, 'like:x' resolved by `plan.tensor_dtype(x)`."""
        return nbytes(self.shape, resolve_dtype(self.dtype, plan.tensor_dtype))


@dataclass(frozen=True)
class Launch:
    """One kernel call, kernel[grid](...), every argument bound by parameter name.

    inputs   {param: name of a tensor read (a user input or an earlier Out), or None}
    scalars  {param: Python int or float}
    outputs  {param: Out written, or None}
    constexprs {param: value}

    None marks an absent tensor, which the executor fills with any valid pointer
    (the kernel's constexpr flag keeps it unread). Every output is fully written
    by the kernel, so buffers need no zeroing. Built only if the four dicts bind
    each parameter of the kernel exactly once (those with defaults may be left
    out), tensors and scalars ahead of the constexprs and outputs after the
    tensors and scalars they read (jax-triton passes outputs last); else a
    TypeError naming the parameter.
    """

    kernel: object
    grid: tuple
    inputs: dict
    scalars: dict
    outputs: dict
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 1
    # The launch's cost at the plan's shape, for `parity.compiled --report`: FLOPs of
    # its tl.dot products and the HBM bytes it must move (0 where not modelled).
    dot_flops: int = 0
    bytes: int = 0

    def __post_init__(self):
        object.__setattr__(self, "_order", _bind(self))

    def arguments(self) -> list:
        """[(param, kind, value)] of the runtime parameters in the kernel's order:
        kind "in" (value a tensor name or None), "scalar" or "out" (an Out or None);
        the "out" ones come last."""
        return self._order

    def reads(self) -> list:
        """Names of the tensors it reads (absent ones left out)."""
        return [v for _, kind, v in self._order if kind == "in" and v is not None]

    def writes(self) -> list:
        """The Outs it writes."""
        return [v for _, kind, v in self._order if kind == "out" and v is not None]


_PARAMS: dict = {}  # kernel -> (parameter names, those with a default)


def _parameters(kernel) -> tuple:
    params = _PARAMS.get(kernel)
    if params is None:
        names = getattr(kernel, "arg_names", None)
        if names is None:
            raise TypeError(f"kernel: expected a Triton kernel (with arg_names), "
                            f"got {type(kernel).__name__}")
        fn = getattr(kernel, "fn", kernel)
        try:
            optional = {n for n, p in inspect.signature(fn).parameters.items()
                        if p.default is not p.empty}
        except (TypeError, ValueError):
            optional = set()
        params = _PARAMS[kernel] = (tuple(names), frozenset(optional))
    return params


_ORDERS: dict = {}  # (kernel, the bound names by kind) -> [(param, kind)] in kernel order


def _bind(launch) -> list:
    """The runtime arguments of `launch` in kernel order (see Launch), or a TypeError.
    The check depends only on the kernel and the names bound, so it runs once for each."""
    key = (launch.kernel, *(tuple(d) if isinstance(d, dict) else d for d in (
        launch.inputs, launch.scalars, launch.outputs, launch.constexprs)))
    try:
        order = _ORDERS.get(key)
    except TypeError:  # unhashable: _order_of says what is wrong
        order = None
    if order is None:
        order = _ORDERS[key] = _order_of(launch)
    ins, scalars, outs = launch.inputs, launch.scalars, launch.outputs
    return [(p, kind, (ins if kind == "in" else scalars if kind == "scalar" else outs)[p])
            for p, kind in order]


def _order_of(launch) -> list:
    """[(param, kind)] of the runtime parameters in kernel order, after checking that the
    four dicts of `launch` bind each parameter of its kernel once, in an order the
    executors can pass (see Launch)."""
    names, optional = _parameters(launch.kernel)
    kname = getattr(launch.kernel, "__name__", "kernel")
    kinds = {}
    for kind, given in (("in", launch.inputs), ("scalar", launch.scalars),
                        ("out", launch.outputs), ("constexpr", launch.constexprs)):
        if not isinstance(given, dict):
            raise TypeError(f"{kname}: {kind} arguments must be a dict by parameter name, "
                            f"got {type(given).__name__}")
        for p in given:
            if p in kinds:
                raise TypeError(f"{kname}: parameter {p!r} bound twice ({kinds[p]} and {kind})")
            if p not in names:
                raise TypeError(f"{kname}: no parameter named {p!r} (its parameters: "
                                f"{', '.join(names)})")
            kinds[p] = kind
    missing = [p for p in names if p not in kinds and p not in optional]
    if missing:
        raise TypeError(f"{kname}: parameter {missing[0]!r} not bound"
                        + (f" (nor {', '.join(map(repr, missing[1:]))})" if missing[1:] else ""))
    order = [(p, kinds[p]) for p in names if p in kinds]
    seen_constexpr = seen_out = None
    for p, kind in order:
        if kind == "constexpr":
            seen_constexpr = seen_constexpr or p
        elif seen_constexpr:
            raise TypeError(f"{kname}: runtime parameter {p!r} follows constexpr "
                            f"{seen_constexpr!r} (the executors pass constexprs by keyword "
                            f"after every runtime argument)")
        elif kind == "out":
            seen_out = seen_out or p
        elif seen_out:
            raise TypeError(f"{kname}: {kind} parameter {p!r} follows output {seen_out!r} "
                            f"(jax-triton passes outputs after every input and scalar)")
    return [(p, kind) for p, kind in order if kind != "constexpr"]


def resolve_dtype(spec: str, dtype_of) -> object:
    """'like:q' -> dtype_of('q'), any other name as is. `dtype_of`: a function of a
    tensor name, or a dict of tensors (their `.dtype`)."""
    if spec.startswith("like:"):
        name = spec[5:]
        return dtype_of[name].dtype if isinstance(dtype_of, dict) else dtype_of(name)
    return spec
