"""Each implementation is checked against the float64 oracle before it is timed:
a wrong anchor setup must not produce a ratio."""

import numpy as np

from parity import compare, oracle

from .anchors import GRAD_NAMES

CHECK_SIZE = dict(B=1, T=96, H=2, K=16, V=16)  # T not a chunk multiple: tails are checked too
TOL = compare.TOLERANCE["float32"]


def inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> dict:
    """float32 q,k [B,T,H,K], v, do [B,T,H,V], g [B,T,H,K] log-gates in [-0.5, -0.01]."""
    rng = np.random.default_rng(seed)
    a = {"q": rng.standard_normal((B, T, H, K)), "k": rng.standard_normal((B, T, H, K)),
         "v": rng.standard_normal((B, T, H, V)), "g": -rng.uniform(0.01, 0.5, (B, T, H, K)),
         "do": rng.standard_normal((B, T, H, V))}
    return {n: x.astype(np.float32) for n, x in a.items()}


def reference(a: dict) -> tuple:
    """Oracle o and gradients of sum(o * do) for q, k, v, g (the key-dim gate)."""
    o, _ = oracle.recurrent(a["q"], a["k"], a["v"], gk=a["g"])
    d = oracle.recurrent_grads(a["q"], a["k"], a["v"], gk=a["g"], do=a["do"])
    d["g"] = d.pop("gk")
    return o, d


def check(impl, a: dict = None, ref: tuple = None) -> dict:
    """{"fwd": None or reason, "fwdbwd": None or reason}: None when the mode matches the
    oracle within the fp32 tolerance; otherwise why it cannot be timed."""
    a = a if a is not None else inputs(**CHECK_SIZE)
    o_ref, d_ref = ref if ref is not None else reference(a)
    try:
        fwd, fwdbwd = impl.build(a)
    except Exception as e:  # an anchor that cannot even be set up is reported, not fatal
        reason = f"error: {type(e).__name__}: {_first_line(e)}"
        return {"fwd": reason, "fwdbwd": reason}
    out = {}
    for mode, run in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        try:
            got = run()
        except Exception as e:
            out[mode] = f"error: {type(e).__name__}: {_first_line(e)}"
            continue
        if mode == "fwd":
            errs = {"o": compare.rel_err(np.asarray(got), o_ref)}
        else:
            errs = {"d" + n: compare.rel_err(np.asarray(got[n]), d_ref[n]) for n in GRAD_NAMES}
        bad = {n: e for n, e in errs.items() if not e <= TOL}
        out[mode] = None if not bad else "wrong result vs oracle: " + ", ".join(
            f"{n} rel err {e:.1e}" for n, e in bad.items())
    return out


def _first_line(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else "")[:160]
