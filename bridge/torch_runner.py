"""Runs `bridge` launch lists on torch tensors.

The PyTorch launcher, and the JAX launcher on CPU (through a host callback and
DLPack), both execute the kernels here: on CUDA tensors compiled, on CPU
tensors in Triton's interpreter.

Configs: each Launch carries the warps and stages its plan chose (checked
ahead of time by `parity.compiled --report`). GLA_BRIDGE_AUTOTUNE=1 makes the torch
launch on CUDA autotune warps and stages per kernel variant instead
(`triton.autotune`, keyed on the variant's constexprs and dtypes; tiles stay the
plan's, since the grid depends on them). It is off by default: on an H100 it
cost minutes of compiles per variant (9 configs per kernel) and won nothing on
the forward at (8,4096,16,128,128) bf16 (4.45 ms tuned vs 4.22 ms with the
plan's config from JAX). The interpreter and JAX (whose launch must be fixed at
trace time) always run the plan's config.

`wrap=True` (the torch ops on CUDA) launches through `torch.library.wrap_triton`,
so torch.compile traces each kernel call into its graph for Inductor.
"""

import contextlib
import os
import threading

import torch

from .launch import resolve_dtype

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_TUNED = {}
# Triton's interpreter keeps per-launch state in module globals: launches from
# several threads at once (JAX's host callbacks, one per device) corrupt each
# other, so interpreted runs go one at a time. Compiled CUDA launches need no lock.
INTERPRETER_LOCK = threading.RLock()
CONFIGS = tuple((w, s) for w in (2, 4, 8) for s in (1, 2, 3))  # (num_warps, num_stages)


def autotuning() -> bool:
    return os.environ.get("GLA_BRIDGE_AUTOTUNE", "0") == "1"


def tuned(launch, do_bench=None):
    """The launch's kernel under triton.autotune over CONFIGS (the plan's own
    config among them), one autotuner per kernel and set of constexpr names."""
    import triton

    key = (launch.kernel, tuple(sorted(launch.constexprs)), do_bench)
    if key not in _TUNED:
        configs = [triton.Config({}, num_warps=w, num_stages=s) for w, s in CONFIGS]
        _TUNED[key] = triton.autotune(configs=configs, key=sorted(launch.constexprs),
                                      do_bench=do_bench)(launch.kernel)
    return _TUNED[key]


def run(launches, env: dict, autotune=None, do_bench=None, wrap=False) -> dict:
    """Execute the launches in order, arguments passed in the kernel's parameter order
    (`Launch.arguments`); their outputs are added to `env` by name.
    Absent inputs and outputs get `env['q']` as a dummy pointer (never touched:
    the kernel's flag for it is off). `autotune` defaults to CUDA tensors with
    GLA_BRIDGE_AUTOTUNE=1; `do_bench` replaces Triton's timer (tests)."""
    dummy = env["q"]
    if not dummy.is_cuda:
        from . import kernels

        if not kernels.INTERPRETED:
            raise RuntimeError(
                "the Triton kernels on CPU tensors need Triton's interpreter, but triton was "
                "imported before bridge.kernels without TRITON_INTERPRET=1 (its library is "
                "then compiled-mode only): import gla-bridge first, or set TRITON_INTERPRET=1 "
                "before anything imports triton")
    with (contextlib.nullcontext() if dummy.is_cuda else INTERPRETER_LOCK):
        return _run(launches, env, autotune, do_bench, wrap)


def _run(launches, env, autotune, do_bench, wrap):
    dummy = env["q"]
    if autotune is None:
        autotune = dummy.is_cuda and autotuning()
    if wrap:
        from torch.library import wrap_triton
    for launch in launches:
        args = []
        for _, kind, value in launch.arguments():
            if kind == "scalar":
                args.append(value)
            elif value is None:
                args.append(dummy)
            elif kind == "in":
                args.append(env[value])
            else:
                dtype = resolve_dtype(value.dtype, env)
                env[value.name] = torch.empty(value.shape, dtype=_DTYPES.get(dtype, dtype),
                                              device=dummy.device)
                args.append(env[value.name])
        if autotune:
            kernel = tuned(launch, do_bench)
            (wrap_triton(kernel) if wrap else kernel)[launch.grid](*args, **launch.constexprs)
        else:
            kernel = wrap_triton(launch.kernel) if wrap else launch.kernel
            kernel[launch.grid](*args, **launch.constexprs, num_warps=launch.num_warps,
                                num_stages=launch.num_stages)
    return env
