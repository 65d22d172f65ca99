"""How results are compared: one error measure and one table of tolerances."""

import numpy as np

# Relative-norm tolerance by the dtype the inputs were given in. Inputs are
# rounded to that dtype BEFORE the oracle sees them, so what remains is the
# backend's own rounding: outputs and gradients stored in the input dtype
# (bf16 has 8 mantissa bits, fp16 11) and fp32 accumulation.
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


GATE_GRADS = ("dg", "dgk", "dgv", "dg_gamma")


def rel_err(got, want, floor: float = 0.0) -> float:
    """||got - want|| / max(||want||, floor * sqrt(size)) in float64 (absolute
    error when that is 0); inf when shapes differ or got is not finite."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return float("inf")
    scale = max(np.linalg.norm(want), floor * np.sqrt(want.size))
    diff = np.linalg.norm(got - want)
    return float(diff / scale) if scale > 0 else float(diff)


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]


def assert_close(errs: dict, dtype: str = "float32", tol: float = None):
    """Raise AssertionError naming every error of `errs` ({quantity: relative error})
    above `tol`, by default `dtype`'s tolerance."""
    tol = tolerance(dtype) if tol is None else tol
    bad = {k: v for k, v in errs.items() if not v <= tol}
    if bad:
        raise AssertionError(f"relative errors above {tol}: {bad} (all: {errs})")


def errors(got: dict, want: dict, gate_grad_floor: float = 0.0) -> dict:
    """{quantity: relative error} over every quantity either side has (a
    quantity only one side has counts as inf). Gate gradients are measured
    against an RMS floor of `gate_grad_floor` (see `cases.Case`)."""
    out = {}
    for key in sorted(set(got) | set(want)):
        if key not in got or key not in want:
            out[key] = float("inf")
        else:
            floor = gate_grad_floor if key in GATE_GRADS else 0.0
            out[key] = rel_err(got[key], want[key], floor)
    return out
