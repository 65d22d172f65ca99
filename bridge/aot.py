"""Ahead-of-time compile of the Triton kernel variants, with no GPU.

    TRITON_INTERPRET=0 python -m bridge.aot --arch 90 [--json PATH]

builds every launch of `VARIANTS` (through the same launch lists the
frameworks run) to cubin for the given CUDA arch, and prints one line per
kernel variant with its shared memory, registers and spills. Exits 1 if any
variant fails to build or needs more shared memory than the arch has.
"""

import argparse
import json
import os
import re
import sys
import time

SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_TL = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}


def _variants():
    """(label, plan, input dtypes) covering every flag value, dtype and block size."""
    from .contract import Plan

    def plan(K=64, V=64, H=2, Hk=1, g="none", gk=False, gv=False, g_gamma="none", h0=False,
             reverse=False, varlen=False, dtype="float32"):
        return Plan(B=1, T=64, H=H, Hk=Hk, K=K, V=V, N=2 if varlen else 1, g=g, gk=gk, gv=gv,
                    g_gamma=g_gamma, initial_state=h0, scale=K ** -0.5, reverse=reverse,
                    varlen=varlen, packed=False, dtype=dtype)

    out = [("plain", plan()),
           ("g-head", plan(g="head")), ("g-key", plan(g="key")), ("gk", plan(gk=True)),
           ("gv", plan(gv=True)), ("gamma-head", plan(g_gamma="head")),
           ("gamma-seq+varlen", plan(g_gamma="seq", varlen=True)),
           ("h0+reverse", plan(h0=True, reverse=True)), ("gqa", plan(H=4, Hk=2))]
    everything = dict(g="key", gk=True, gv=True, g_gamma="seq", h0=True, reverse=True,
                      varlen=True, H=4, Hk=2)
    for dtype in ("float32", "float16", "bfloat16"):
        out.append((f"all-{dtype}", plan(dtype=dtype, **everything)))
    for K, V in ((16, 16), (32, 48), (100, 100), (128, 128), (256, 256), (256, 64)):
        out.append((f"K{K}-V{V}", plan(K=K, V=V, g="head", gv=True, h0=True)))
    return out


def _dtype_of(name, plan):
    """The dtype a launch sees for a named tensor in these variants."""
    if name in ("q", "k", "v", "g", "gk", "gv", "g_gamma", "do", "o"):
        return plan.dtype
    if name == "cu_seqlens":
        return "int32"
    return "float32"  # states and every backward buffer


def compile_launch(launch, plan, arch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = launch.kernel
    names = launch.inputs
    ptrs = [_TL[_dtype_of(n or "q", plan)] for n in names]  # absent: the dummy is q
    ptrs += [_TL[plan.dtype if o is None or o.dtype.startswith("like:") else o.dtype]
             for o in launch.outputs]
    n_in = len(names)
    sig, constexprs = {}, {}
    params = fn.arg_names
    scalars = iter(launch.scalars)
    for i, p in enumerate(params):
        if p in launch.constexprs:
            sig[p] = "constexpr"
            constexprs[p] = launch.constexprs[p]
        elif i < n_in:
            sig[p] = "*" + ptrs[i]
        elif i < n_in + len(launch.scalars):
            sig[p] = "fp32" if isinstance(next(scalars), float) else "i32"
        else:
            sig[p] = "*" + ptrs[i - len(launch.scalars)]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    return dict(shared=k.metadata.shared, **_ptxas_usage(k.asm["ptx"], arch))


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes, from Triton's bundled ptxas (-v), since the
    compiled kernel reports them only once loaded onto a GPU."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch_name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={arch_name}", path,
                              "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    log = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_bytes=sum(int(x) for x in spills) if spills else None)


def _stages(families, plan):
    """(stage, launches) of each family's forward and backward lists for `plan`."""
    for fam in families:
        yield "fwd", fam.forward_launches(plan)
        yield "bwd", fam.backward_launches(plan, use_dht=True)
        yield "bwd-nodht", fam.backward_launches(plan, False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json")
    ap.add_argument("--family", choices=("fused_recurrent", "chunk", "all"),
                    default="fused_recurrent",
                    help="which kernel family's launch lists to build")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("bridge.aot: run with TRITON_INTERPRET=0 (the interpreter has no compiler)")
    os.environ.setdefault("TRITON_INTERPRET", "0")
    from .kernels import chunk, fused_recurrent

    families = {"fused_recurrent": [fused_recurrent], "chunk": [chunk],
                "all": [fused_recurrent, chunk]}[args.family]
    rows, failed, built = [], 0, set()
    for label, plan in _variants():
        for stage, launches in _stages(families, plan):
            if stage == "bwd-nodht" and label not in ("plain", "all-float32"):
                continue
            for launch in launches:
                # a kernel two families share (the combine pass) is built once per variant
                key = (label, stage, launch.kernel.__name__,
                       repr(sorted(launch.constexprs.items())))
                if key in built:
                    continue
                built.add(key)
                row = dict(variant=label, stage=stage, kernel=launch.kernel.__name__,
                           arch=args.arch)
                t0 = time.time()
                try:
                    row.update(compile_launch(launch, plan, args.arch))
                    row["ok"] = row["shared"] <= SMEM_LIMIT.get(args.arch, 99 * 1024)
                except Exception as e:  # report every failure, keep going
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
                row["seconds"] = round(time.time() - t0, 2)
                failed += not row["ok"]
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{len(rows) - failed} built, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
