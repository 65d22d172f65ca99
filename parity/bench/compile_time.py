"""Compile time of the torch layers under torch.compile(fullgraph=True) with Inductor:
GatedLinearAttention and LightningAttention, forward+backward, on platform="torch" and on
the Triton path (fused_recurrent; interpreted on CPU, inside the opaque gla_bridge op).

Each (layer, platform) runs in its own subprocess with an empty Inductor cache, so the
figure is a cold compile, what a fresh process pays; the sequence length is marked
dynamic and a second length must run without a recompile. `measure()` returns the
markdown section; `python -m parity.bench.compile_time` prints it.
"""

import json
import os
import subprocess
import sys
import tempfile

LAYERS = ("GatedLinearAttention", "LightningAttention")
PLATFORMS = (("torch", "auto"), ("triton", "fused_recurrent"))
SHAPE = dict(B=2, T=32, T2=48, hidden=64, heads=2)
TARGET_S = 30.0


def _child(layer, platform, mode) -> dict:
    """One cold compile in this process: times of the first compiled forward+backward
    (compile included), a steady one, an eager one, and a second length's."""
    import time

    import bridge.kernels  # noqa: F401  (interpreter decision before triton loads)
    import torch
    import torch_side

    torch.manual_seed(0)
    m = getattr(torch_side, layer)(hidden_size=SHAPE["hidden"], num_heads=SHAPE["heads"],
                                   platform=platform, mode=mode)

    def step(x, state):
        o, s = m(x, state=state, use_cache=True)
        return o, s

    def fwd_bwd(fn, T, cpu=False):
        x = torch.randn(SHAPE["B"], T, SHAPE["hidden"])
        torch._dynamo.mark_dynamic(x, 1)
        s0 = torch.randn(*m.config.state_shape(SHAPE["B"]))
        t, c = time.perf_counter(), time.process_time()
        o, s = fn(x, s0)
        (o.square().sum() + s.sum()).backward()
        return (time.perf_counter() - t, time.process_time() - c) if cpu else \
            time.perf_counter() - t

    breaks = torch._dynamo.explain(step)(torch.randn(SHAPE["B"], SHAPE["T"], SHAPE["hidden"]),
                                         torch.randn(*m.config.state_shape(SHAPE["B"])))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    load = os.getloadavg()[0]
    first, first_cpu = fwd_bwd(compiled, SHAPE["T"], cpu=True)
    steady, steady_cpu = min(fwd_bwd(compiled, SHAPE["T"], cpu=True) for _ in range(2))
    eager = min(fwd_bwd(step, SHAPE["T"]) for _ in range(2))
    with torch.compiler.set_stance("fail_on_recompile"):
        other = fwd_bwd(compiled, SHAPE["T2"])
    return dict(layer=layer, platform=platform, mode=mode, graph_breaks=breaks.graph_break_count,
                first_s=first, steady_s=steady, eager_s=eager, second_length_s=other,
                compile_s=first - steady, compile_cpu_s=first_cpu - steady_cpu,
                load=max(load, os.getloadavg()[0]))


def run(log=print) -> list:
    """Every (layer, platform), each in a fresh subprocess with an empty Inductor cache."""
    out = []
    for layer in LAYERS:
        for platform, mode in PLATFORMS:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache,
                           TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
                cmd = [sys.executable, "-m", "parity.bench.compile_time", "--child", layer,
                       platform, mode]
                log(f"compile time: {layer} platform={platform} mode={mode}")
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line = proc.stdout.strip().splitlines()[-1:] or [""]
                if proc.returncode or not line[0].startswith("{"):
                    raise SystemExit(f"compile-time child failed: {proc.stderr[-2000:]}")
                out.append(json.loads(line[0]))
    return out


def section(results) -> str:
    """The markdown section."""
    B, T, T2, D, H = (SHAPE[k] for k in ("B", "T", "T2", "hidden", "heads"))
    lines = [f"`torch.compile(layer_step, fullgraph=True)` (Inductor), forward+backward of one "
             f"step with a state, x [{B}, T, {D}], {H} heads, T marked dynamic; a cold compile "
             f"(fresh process, empty Inductor cache). compile = first call - steady call, wall "
             f"clock; compile CPU: the same in this process's CPU time (without the C++ "
             f"compiler's subprocesses), which other load does not inflate; load: the 1-minute "
             f"load average (2 cores: above 2, other work shared the CPU). The second length "
             f"(T={T2}) runs with recompiles forbidden. Target: compile under "
             f"{TARGET_S:.0f} s on this CPU.", "",
             f"| layer | platform | graph breaks | compile s | compile CPU s | load | "
             f"first call s | steady s (T={T}) | eager s | T={T2} s | under {TARGET_S:.0f} s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        plat = r["platform"] if r["platform"] == "torch" else f"{r['platform']} ({r['mode']})"
        lines.append(f"| {r['layer']} | {plat} | {r['graph_breaks']} | {r['compile_s']:.1f} | "
                     f"{r['compile_cpu_s']:.1f} | {r['load']:.1f} | {r['first_s']:.1f} | "
                     f"{r['steady_s']:.3f} | {r['eager_s']:.3f} | "
                     f"{r['second_length_s']:.3f} | "
                     f"{'yes' if r['compile_s'] < TARGET_S else 'no'} |")
    return "\n".join(lines)


def measure(log=print) -> str:
    """Run every measurement and return the markdown section."""
    return section(run(log))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(_child(*sys.argv[2:])))
    elif len(sys.argv) == 1:
        print(measure(log=lambda s: print(s, file=sys.stderr)))
    else:
        raise SystemExit("usage: python -m parity.bench.compile_time  (no arguments; a few "
                         "minutes: prints the markdown section)")
