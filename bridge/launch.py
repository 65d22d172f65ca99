"""Framework-neutral description of kernel launches.

A kernel module turns a `Plan` into a list of `Launch`es; each framework runs
the list with its own executor (torch: direct Triton launch; JAX: jax-triton
or a host callback). Every launch reads named tensors (user inputs or outputs
of earlier launches) and writes named outputs, so the sequence of kernels and
the sizes of every buffer are written once, here in `bridge`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Out:
    """An output buffer: its name, shape and dtype name ('float32', or 'like:q')."""

    name: str
    shape: tuple
    dtype: str = "float32"


@dataclass(frozen=True)
class Launch:
    """One kernel call: kernel(*inputs, *scalars, *outputs, **constexprs)[grid].

    `inputs` are names; None marks an absent tensor, which the executor fills
    with any valid pointer (the kernel's constexpr flag keeps it unread).
    Every output is fully written by the kernel, so buffers need no zeroing.
    """

    kernel: object
    grid: tuple
    inputs: tuple
    scalars: tuple
    outputs: tuple
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 1
    # The launch's cost at the plan's shape, for `bridge.aot --report`: FLOPs of
    # its tl.dot products and the HBM bytes it must move (0 where not modelled).
    dot_flops: int = 0
    bytes: int = 0


def resolve_dtype(spec: str, env: dict) -> object:
    """'like:q' -> env['q'].dtype; any other name is returned as is."""
    if spec.startswith("like:"):
        return env[spec[5:]].dtype
    return spec
