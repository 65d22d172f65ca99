"""BENCHMARKS.md's multi-device section: context parallelism on 8 host devices.

`run()` starts one child process with XLA_FLAGS=--xla_force_host_platform_device_count=8
(`python -m parity.bench.multidevice --child`), which compiles one training step
(forward + gradients of every input) of `jax_side.recurrent(..., context_axis="cp")`
inside `jax.shard_map` at T = 65,536 for P = 1, 2, 4, 8 devices, and reads from the
compiled program: per-device memory (`memory_analysis()`: arguments + outputs +
temporaries) and the bytes of every collective in the HLO (`collective_bytes`); then
times a few steps. `section()` renders the markdown.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

SHAPE = dict(B=1, T=65536, H=4, K=64, V=64)
DEVICES = (1, 2, 4, 8)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute",
               "all-to-all")
_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "pred": 1,
          "s8": 1, "u8": 1}


def collective_bytes(hlo_text: str) -> list:
    """[(op, result bytes)] for every collective in a compiled HLO module's text (the
    result of an all-gather is what each device receives)."""
    out = []
    for line in hlo_text.splitlines():
        for op in COLLECTIVES:
            m = re.search(rf"= (.*?) {op}(-start)?\(", line)
            if m:
                n = 0
                for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
                    size = 1
                    for d in filter(None, dims.split(",")):
                        size *= int(d)
                    n += _BYTES.get(dtype, 4) * size
                out.append((op, n))
    return out


def _child() -> list:
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_side

    B, T, H, K, V = (SHAPE[n] for n in "BTHKV")
    r = np.random.default_rng(0)
    x = {"q": r.standard_normal((B, T, H, K)), "k": r.standard_normal((B, T, H, K)),
         "v": r.standard_normal((B, T, H, V)), "g": -r.uniform(0.01, 0.5, (B, T, H, K)),
         "initial_state": r.standard_normal((B, H, K, V))}
    names = tuple(x)
    arrays = [jnp.asarray(a, jnp.float32) for a in x.values()]
    rows = []
    for n in DEVICES:
        mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
        specs = tuple(P() if name == "initial_state" else P(None, "cp") for name in names)
        fn = jax.shard_map(
            lambda *a: jax_side.recurrent(**dict(zip(names, a)), platform="xla",
                                          context_axis="cp"),
            mesh=mesh, in_specs=specs, out_specs=(P(None, "cp"), P()))
        step = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)[0]) + jnp.sum(fn(*a)[1]),
                                argnums=tuple(range(len(names)))))
        compiled = step.lower(*arrays).compile()
        mem = compiled.memory_analysis()
        coll = collective_bytes(compiled.as_text())
        times = []
        for _ in range(3):
            t = time.perf_counter()
            jax.block_until_ready(step(*arrays))
            times.append(time.perf_counter() - t)
        rows.append(dict(devices=n, tokens_per_device=T // n,
                         argument_bytes=mem.argument_size_in_bytes,
                         output_bytes=mem.output_size_in_bytes,
                         temp_bytes=mem.temp_size_in_bytes,
                         collectives=coll, collective_bytes=sum(b for _, b in coll),
                         state_bytes=B * H * (K * V + K + V) * 4,
                         step_s=sorted(times)[1]))
    return rows


def run(log=print) -> dict:
    """The measurements, from a child process with 8 host devices."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    log("multi-device: compiling and timing context parallelism at T=65,536 on 8 host devices")
    out = subprocess.run([sys.executable, "-m", "parity.bench.multidevice", "--child"],
                         env=env, cwd=root, capture_output=True, text=True, check=True)
    return dict(shape=SHAPE, rows=json.loads(out.stdout.strip().splitlines()[-1]))


def section(data) -> str:
    """The markdown section."""
    if not data:
        return ("not measured in this run (`python -m parity.bench --multidevice` "
                "measures it).")
    s = data["shape"]
    mib = lambda b: f"{b / 2 ** 20:.1f}"  # noqa: E731
    lines = [
        f"Context parallelism (`jax_side.recurrent(..., context_axis=\"cp\")` inside "
        f"`jax.shard_map`, platform xla): one training step (forward + gradients of q, k, v, "
        f"g and the initial state) at B={s['B']}, T={s['T']:,}, H={s['H']}, K={s['K']}, "
        f"V={s['V']}, float32, the time axis split over P of 8 host devices "
        f"(`XLA_FLAGS=--xla_force_host_platform_device_count=8`). Memory is XLA's "
        f"`memory_analysis()` of the compiled per-device program; collective bytes are "
        f"the results of every collective in its HLO (per device, per step). The bound is "
        f"the issue's: P x N x H x (K V + K + V) x 4 bytes x 2 per direction.",
        "",
        "| P | tokens / device | arguments MiB | outputs MiB | temporaries MiB | "
        "collectives (op: bytes) | collective bytes | bound (x2 directions) | step s |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        ops = ", ".join(f"{op}: {n:,}" for op, n in r["collectives"]) or "none"
        bound = r["devices"] * r["state_bytes"] * 2 * 2
        lines.append(f"| {r['devices']} | {r['tokens_per_device']:,} | "
                     f"{mib(r['argument_bytes'])} | {mib(r['output_bytes'])} | "
                     f"{mib(r['temp_bytes'])} | {ops} | {r['collective_bytes']:,} | "
                     f"{bound:,} | {r['step_s']:.2f} |")
    lines += ["", "The host devices share this machine's two CPU cores, so the step times "
              "are not a scaling result: they only show that the step runs. What carries "
              "over to real devices is the per-device memory, which falls with P, and the "
              "collective bytes, which depend on P and the state size, not on T."]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(_child()))
    else:
        print(section(run()))
