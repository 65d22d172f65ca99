"""`python -m jax_side.tpu_report [--shape B,T,H,K,V] [--dtype bf16|fp32] [--fn NAME ...] [--json]`

TPU readiness of the Pallas kernels without a TPU: exports a public function
(forward and `jax.grad`) for platform "tpu", which runs the real Mosaic lowering
on this host, and reads every kernel's Mosaic module (`pallas_call(debug=True)`
prints it): the `tpu.matmul` ops with operand dtypes and shapes, the grid, the
VMEM of the double-buffered blocks and scratch, the `pl.CostEstimate`, and a
lower bound per TPU from the MXU FLOPs (bf16 products at the chip's rate, fp32
HIGHEST products as six bf16 passes) and the HBM bytes. Nothing here is a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import sys

import jax
import jax.numpy as jnp

import jax_side
from jax_side import pallas

SHAPE = (8, 4096, 16, 128, 128)  # B, T, H, K, V
# (name, bf16 MXU FLOP/s, HBM bytes/s): Google's published per-chip figures
TPUS = (("v5e", 197e12, 819e9), ("v5p", 459e12, 2.76e12))
F32_PASSES = 6  # Precision.HIGHEST: an fp32 product as six bf16 passes
FNS = {  # public function: the gate inputs it takes besides q, k, v
    "recurrent_gla": ("gk",),
    "lightning_attn": (),
    "recurrent": ("g", "gv"),
}
_MATMUL = re.compile(r"tpu\.matmul .*: vector<([0-9x]+)x(\w+)>, vector<([0-9x]+)x(\w+)>, "
                     r"vector<([0-9x]+)x\w+> -> vector<([0-9x]+)x\w+>")


def _args(fn, shape, dtype):
    B, T, H, K, V = shape
    sd = jax.ShapeDtypeStruct
    a = [sd((B, T, H, K), dtype), sd((B, T, H, K), dtype), sd((B, T, H, V), dtype)]
    gates = {"gk": sd((B, T, H, K), jnp.float32), "g": sd((B, T, H), jnp.float32),
             "gv": sd((B, T, H, V), jnp.float32)}
    return a + [gates[n] for n in FNS[fn]]


def call(fn, *a, cu_seqlens=None):
    """Public function `fn` on platform="pallas": q, k, v, then the gates FNS[fn] names."""
    if fn == "lightning_attn":
        return jax_side.lightning_attn(*a[:3], layer_idx=0, num_layers=2, cu_seqlens=cu_seqlens,
                                       platform="pallas")
    kw = dict(zip(FNS[fn], a[3:]))
    return getattr(jax_side, fn)(*a[:3], **kw, cu_seqlens=cu_seqlens, platform="pallas")


def matmuls(text):
    """{kernel: [(lhs shape, lhs dtype, rhs shape, rhs dtype, out shape)]} of Mosaic text."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"func\.func @(gla_\w+)\(", line)
        if m:
            cur = m.group(1)
            out.setdefault(cur, [])
        m = _MATMUL.search(line)
        if m and cur is not None:
            dims = lambda s: tuple(int(x) for x in s.split("x"))
            out[cur].append((dims(m.group(1)), m.group(2), dims(m.group(3)), m.group(4),
                             dims(m.group(6))))
    return out


def export(fn, shape=SHAPE, dtype=jnp.bfloat16, grad=False):
    """(exported StableHLO text, Mosaic debug text, launch records) of one export."""
    args = _args(fn, shape, dtype)
    if grad:
        def f(*a):
            loss = lambda *x: call(fn, *x)[0].astype(jnp.float32).sum()
            return jax.grad(loss, tuple(range(len(a))))(*a)
    else:
        f = lambda *a: call(fn, *a)
    buf = io.StringIO()
    with pallas.recording(debug=True) as rec, contextlib.redirect_stdout(buf):
        exp = jax.export.export(jax.jit(f), platforms=["tpu"])(*args)
    return exp.mlir_module(), buf.getvalue(), list(rec)


def report(fn="recurrent_gla", shape=SHAPE, dtype="bf16"):
    """Per kernel launch of the forward and of fwd+bwd: matmuls, grid, VMEM, cost, bounds."""
    dt = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[dtype]
    out = dict(fn=fn, shape=list(shape), dtype=dtype, passes={})
    for name, grad in (("forward", False), ("fwd+bwd", True)):
        hlo, text, rec = export(fn, shape, dt, grad)
        mms = matmuls(text)
        launches = []
        for r in rec:
            ops = mms.get(r["kernel"], [])
            n = math.prod(r["grid"])
            fl = {"bf16": 0, "f32": 0}
            for lhs, ld, rhs, rd, res in ops:
                kdim = math.prod(lhs) // res[-2]  # lhs is [M, K] or, transposed, [K, M]
                kind = "bf16" if ld == rd == "bf16" else "f32"
                fl[kind] += 2 * math.prod(res) * kdim * n
            bounds = {}
            for chip, peak, bw in TPUS:
                mxu = (fl["bf16"] + F32_PASSES * fl["f32"]) / peak
                bounds[chip] = max(mxu, r["bytes_accessed"] / bw) * 1e6
            launches.append(dict(r, grid=list(r["grid"]), matmuls=len(ops),
                                 bf16_matmuls=sum(1 for o in ops if o[1] == o[3] == "bf16"),
                                 rows64_matmuls=sum(1 for o in ops if o[4][-2] >= 64),
                                 shapes=sorted({f"{'x'.join(map(str, o[0]))}{o[1]} @ "
                                                f"{'x'.join(map(str, o[2]))}{o[3]}" for o in ops}),
                                 mxu_flops=fl, lower_bound_us=bounds))
        out["passes"][name] = dict(tpu_custom_calls=hlo.count("tpu_custom_call"),
                                   launches=launches,
                                   lower_bound_us={c: sum(x["lower_bound_us"][c] for x in launches)
                                                   for c, _, _ in TPUS})
    return out


def markdown(rep) -> str:
    """One report as a markdown table (a row per kernel launch)."""
    B, T, H, K, V = rep["shape"]
    lines = [f"`{rep['fn']}` at (B,T,H,K,V) = ({B},{T},{H},{K},{V}), {rep['dtype']}:", "",
             "| pass | kernel | grid | tpu.matmul (bf16 / >= 64 rows) | VMEM KiB "
             "| GFLOP (cost est.) | exp (M) | HBM MB | MXU GFLOP bf16 / f32 | bound v5e us "
             "| bound v5p us |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in rep["passes"].items():
        for r in p["launches"]:
            lines.append(
                f"| {name} | {r['kernel']} | {tuple(r['grid'])} | {r['matmuls']} "
                f"({r['bf16_matmuls']} / {r['rows64_matmuls']}) | {r['vmem_bytes'] / 1024:.0f} | "
                f"{r['flops'] / 1e9:.1f} | {r['transcendentals'] / 1e6:.0f} | "
                f"{r['bytes_accessed'] / 1e6:.0f} | {r['mxu_flops']['bf16'] / 1e9:.1f} / "
                f"{r['mxu_flops']['f32'] / 1e9:.1f} | {r['lower_bound_us']['v5e']:.0f} | "
                f"{r['lower_bound_us']['v5p']:.0f} |")
    lines.append("\nMXU operands per kernel (`tpu.matmul` lhs @ rhs, per grid step):\n")
    for r in rep["passes"]["fwd+bwd"]["launches"]:
        lines.append(f"- {r['kernel']}: " + ", ".join(r["shapes"]))
    for name, p in rep["passes"].items():
        b = p["lower_bound_us"]
        lines.append(f"\n{name}: {p['tpu_custom_calls']} Mosaic kernels; lower bound "
                     f"{b['v5e'] / 1e3:.2f} ms on v5e, {b['v5p'] / 1e3:.2f} ms on v5p.")
    return "\n".join(lines)


def _shape(text):
    dims = tuple(int(x) for x in text.split(","))
    if len(dims) != 5 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"--shape takes B,T,H,K,V, got {text!r}")
    return dims


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_side.tpu_report",
                                description=__doc__.splitlines()[2])
    p.add_argument("--shape", type=_shape, default=SHAPE)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--fn", choices=tuple(FNS), nargs="+", default=["recurrent_gla"])
    p.add_argument("--json", action="store_true", help="the reports as one JSON list")
    a = p.parse_args(argv)
    reps = [report(fn, a.shape, a.dtype) for fn in a.fn]
    if a.json:
        json.dump(reps, sys.stdout, indent=1)
    else:
        print("\n\n".join(markdown(r) for r in reps))


if __name__ == "__main__":
    main()
