"""The Triton kernels, written once and launched by both frameworks.

Triton reads TRITON_INTERPRET when a function is decorated, and its own
standard library (tl.zeros, tl.sum, ...) is decorated when `triton` is first
imported. So the choice is made here, before anything imports triton: with no
active GPU driver (Triton's own test: torch sees no CUDA/ROCm device), the
kernels run in Triton's interpreter on CPU tensors. Set TRITON_INTERPRET
yourself before importing anything to force either way.

When interpreting, `interpreter.install()` then patches Triton's interpreter
for its known bugs (bf16 `tl.dot`); see bridge/kernels/interpreter.py. The
kernels themselves are never duplicated for the interpreter.
"""

import os
import sys


def _gpu_driver_active() -> bool:
    try:
        import torch
    except ImportError:  # Triton's drivers need torch to report a device too
        return False
    return torch.cuda.is_available()


# Triton already imported without the interpreter: its library functions are
# compiled-mode only, so CPU launches cannot work (`bridge.torch_runner.run` says so).
TRITON_PREIMPORTED = "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ
if "TRITON_INTERPRET" not in os.environ and not TRITON_PREIMPORTED and not _gpu_driver_active():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRETED:
    from . import interpreter as _interpreter

    _interpreter.install()


def family(mode: str):
    """The kernel module for a resolved Triton `mode` ("chunk", "fused_recurrent" or
    "fused_chunk"):
    it provides `forward_launches(plan, keep=True)` (keep: also write the buffers `kept`
    names; False for a forward no backward follows), `kept(plan)` (the forward buffers
    the backward reuses, which the frameworks keep) and `backward_launches(plan, use_dht,
    kept)`."""
    if mode == "chunk":
        from . import chunk

        return chunk
    if mode == "fused_recurrent":
        from . import fused_recurrent

        return fused_recurrent
    if mode == "fused_chunk":
        from . import fused_chunk

        return fused_chunk
    raise ValueError(f"mode: expected a resolved kernel family, 'chunk', 'fused_recurrent' or "
                     f"'fused_chunk', got {mode!r}")
