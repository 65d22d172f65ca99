"""Runs before any test module: `bridge.kernels` must decide on Triton's
interpreter before anything imports triton (Triton reads the switch at import)."""

import importlib.util

if importlib.util.find_spec("triton") and importlib.util.find_spec("torch"):
    import bridge.kernels  # noqa: F401
