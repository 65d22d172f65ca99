"""Runs `bridge` launch lists on torch tensors.

The PyTorch launcher, and the JAX launcher on CPU (through a host callback and
DLPack), both execute the kernels here: on CUDA tensors compiled, on CPU
tensors in Triton's interpreter.
"""

import torch

from .launch import resolve_dtype

_DTYPES = {"float32": torch.float32}


def run(launches, env: dict) -> dict:
    """Execute the launches in order; their outputs are added to `env` by name.
    Absent inputs and outputs get `env['q']` as a dummy pointer (never touched:
    the kernel's flag for it is off)."""
    dummy = env["q"]
    for launch in launches:
        args = [dummy if name is None else env[name] for name in launch.inputs]
        outs = []
        for out in launch.outputs:
            if out is None:
                outs.append(dummy)
                continue
            dtype = resolve_dtype(out.dtype, env)
            env[out.name] = torch.empty(out.shape, dtype=_DTYPES.get(dtype, dtype),
                                        device=dummy.device)
            outs.append(env[out.name])
        launch.kernel[launch.grid](*args, *launch.scalars, *outs, **launch.constexprs,
                                   num_warps=launch.num_warps, num_stages=launch.num_stages)
    return env
