"""The compiled kernels on a CUDA GPU (the GPU kit's correctness step: bridge/SPEC.md, "On a GPU").

Every test here launches the kernels compiled for the device, from PyTorch and
from JAX (jax-triton), and compares them with the float64 oracle (run on the
host), with each other, across the two kernel families, with eager torch (the
layers under torch.compile), or with torch's own host-sync detector. Without a
CUDA device they are skipped: the rest of the suite runs the same kernel source
in Triton's interpreter.
"""

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: these tests launch the compiled kernels on a GPU",
                allow_module_level=True)

import bridge.kernels  # noqa: E402
import torch_side  # noqa: E402
from parity import backends, cases  # noqa: E402
from parity.compare import errors, rel_err, tolerance  # noqa: E402

ORACLE = backends.Oracle()
# every gate kind (g per head and per key, gk, gv, g_gamma per head and per sequence), both
# directions, packed sequences (empty and one-token ones among them), several chunks
CASES = [
    cases.Case("gla-chunks", B=2, T=300, H=4, Hk=2, K=64, V=64, g="key", initial_state=True),
    cases.Case("every-gate-varlen", H=2, Hk=1, K=128, V=96, seqlens=(0, 70, 130, 1),
               g="head", gk=True, gv=True, g_gamma="seq", initial_state=True, reverse=True,
               packed=True),
    cases.Case("strong", T=200, H=2, Hk=2, K=32, V=32, g="key", gv=True, gate_scale=10.0,
               gate_grad_floor=0.1),
    cases.Case("reverse-key-gate", B=2, T=150, H=2, Hk=1, K=64, V=32, g="key", gv=True,
               reverse=True),
    cases.Case("varlen-gamma-head", H=4, Hk=4, K=32, V=64, seqlens=(1, 200, 0, 64), gk=True,
               g_gamma="head", initial_state=True, packed=True),
]

MODES = ["chunk", "fused_recurrent", "fused_chunk"]  # every Triton family


def test_compiled_not_interpreted():
    assert not bridge.kernels.INTERPRETED


# the slowest first: pytest-xdist hands tests out in file order
# ---------------------------------------------------------------- torch.compile on CUDA
@pytest.mark.parametrize("layer,mode", [("GatedLinearAttention", "chunk"),
                                        ("LightningAttention", "fused_recurrent")])
def test_compile_fullgraph_layer_on_cuda(layer, mode):
    """torch.compile(fullgraph=True) with Inductor of a layer on CUDA: the op becomes the
    triton_op, whose kernel launches appear in Inductor's generated code; forward,
    final state and every gradient equal eager's."""
    from torch._inductor.utils import run_and_get_code

    from bridge import contract
    from bridge.kernels import family

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = getattr(torch_side, layer)(hidden_size=256, num_heads=4, platform="triton",
                                   mode=mode).cuda()
    x = torch.randn(2, 100, 256, device="cuda")
    s0 = torch.randn(*m.config.state_shape(2), device="cuda")
    w = torch.linspace(-1, 1, 256, device="cuda")

    def step(x, s):
        return m(x, state=s, use_cache=True)

    def fwd_bwd(fn):
        m.zero_grad()
        s = s0.clone().requires_grad_()
        o, sf = fn(x, s)
        ((o * w).sum() + sf.square().sum()).backward()
        return [o, sf, s.grad] + [p.grad for p in m.parameters()]

    got, code = run_and_get_code(fwd_bwd, torch.compile(step, fullgraph=True))
    want = fwd_bwd(step)
    for i, (a, b) in enumerate(zip(got, want)):  # fp32; the kernels' dots may round to tf32
        assert rel_err(a.detach().cpu().numpy(), b.detach().cpu().numpy()) < 1e-3, i
    c = m.config
    q = torch.empty(2, 100, c.num_heads, c.head_k_dim)
    v = torch.empty(2, 100, c.num_heads, c.head_v_dim)
    gates = dict(g=q) if layer == "GatedLinearAttention" else dict(g_gamma=torch.empty(4))
    plan = contract.check(q, q, v, initial_state=s0.cpu(), **gates)
    names = {getattr(lc.kernel, "__name__", None) or lc.kernel.fn.__name__
             for lc in family(mode).forward_launches(plan)}
    assert any(n in text for n in names for text in code), (names, len(code))
    torch._dynamo.reset()


def test_reference_shape_chunk_against_fused():
    """(8, 4096, 16, 128, 128) bf16, forward and backward: the chunked kernels
    against the fused recurrent ones (two independent algorithms)."""
    B, T, H, K, V = 8, 4096, 16, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    q, k, v, do = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V), mk(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda", generator=gen)
                                       ).bfloat16() / 16
    out = {}
    for mode in ("chunk", "fused_recurrent"):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g)]
        o, s = torch_side.recurrent_gla(*leaves, platform="triton", mode=mode)
        grads = torch.autograd.grad((o.float() * do.float()).sum() + s.sum(), leaves)
        out[mode] = [o, s, *grads]
    for name, a, b in zip(("o", "final_state", "dq", "dk", "dv", "dg"), out["chunk"],
                          out["fused_recurrent"]):
        assert torch.isfinite(a).all(), name
        got, want = (x.detach().float().cpu().numpy() for x in (a, b))
        assert rel_err(got, want) < 3e-2, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_launch_matches_oracle(case, mode, dtype):
    arrays = backends.prepared(case, dtype)
    got = backends.TorchBackend("triton", mode).run(case, arrays, dtype)
    errs = errors(got, ORACLE.run(case, arrays, dtype), case.gate_grad_floor)
    assert max(errs.values()) <= tolerance(dtype), errs


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["key-resets", "all-gates-varlen"])
def test_resets_on_the_compiled_kernels(name, mode, reverse):
    """-inf and huge negative finite gates in every gate input (SPEC, "Resets"), packed
    sequences among them, both directions: the compiled kernels give the float64 oracle's
    values and gradients (the interpreter runs the same cases: tests/test_extreme_gates.py)."""
    from test_extreme_gates import CASES, errors as reset_errors

    case, make = CASES[name]
    case = case.with_(reverse=reverse)
    errs, _ = reset_errors(backends.TorchBackend("triton", mode), case, make(case))
    assert max(errs.values()) <= tolerance("float32"), errs


@pytest.mark.skipif(importlib.util.find_spec("jax_triton") is None,
                    reason="jax-triton is not installed: JAX cannot launch Triton kernels on CUDA")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_jax_launch_matches_torch_launch(case, mode):
    """One kernel, two launchers: the same compiled variant from jax-triton and
    from Triton's own launcher gives the same numbers."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("JAX sees no GPU (install jax[cuda12]): jax-triton needs one")
    arrays = backends.prepared(case, "bfloat16")
    got = backends.JaxBackend("triton", mode).run(case, arrays, "bfloat16")
    want = backends.TorchBackend("triton", mode).run(case, arrays, "bfloat16")
    same = errors(got, want)
    assert max(same.values()) <= 1e-6, same


def test_slot_table_on_device_with_traced_lengths():
    """cu_seqlens read only on the device: many sequences of random lengths (some
    empty), one launch list, against the oracle."""
    rng = np.random.default_rng(0)
    seqlens = tuple(int(x) for x in rng.integers(0, 200, 40))
    case = cases.Case("many", H=2, Hk=2, K=64, V=64, seqlens=seqlens, g="key",
                      initial_state=True, packed=True)
    arrays = backends.prepared(case, "float32")
    got = backends.TorchBackend("triton", "chunk").run(case, arrays, "float32")
    errs = errors(got, ORACLE.run(case, arrays, "float32"))
    assert max(errs.values()) <= tolerance("float32"), errs


# ---------------------------------------------------------------- JAX arrays on the CPU
@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_jax_arrays_committed_to_the_cpu_reach_the_compiled_kernels(mode, monkeypatch):
    """JAX inputs committed to the CPU on a GPU machine: the jitted call runs on the CPU
    backend, whose host callback moves them to CUDA for the compiled kernels (on CPU
    tensors they would refuse to run: the interpreter is off), values and gradients
    against the oracle."""
    import jax

    cpu, real = jax.devices("cpu")[0], jax.devices
    # JaxBackend puts its inputs on jax.devices()[0]: here, the CPU
    monkeypatch.setattr(jax, "devices", lambda *a, **k: real(*a, **k) if a or k else [cpu])
    case = CASES[0]
    arrays = backends.prepared(case, "float32")
    got = backends.JaxBackend("triton", mode).run(case, arrays, "float32")
    errs = errors(got, ORACLE.run(case, arrays, "float32"), case.gate_grad_floor)
    assert max(errs.values()) <= tolerance("float32"), errs


# ---------------------------------------------------------------- varlen: no host sync
def _packed_leaves(seqlens, H=2, K=64, V=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(seqlens)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    g = (torch.nn.functional.logsigmoid(torch.randn(total, H, K, device="cuda", generator=gen))
         / 16).bfloat16()
    leaves = [x.requires_grad_() for x in (mk(total, H, K), mk(total, H, K), mk(total, H, V), g)]
    cu = torch.tensor(np.cumsum((0,) + tuple(seqlens)), dtype=torch.int32, device="cuda")
    return leaves, mk(total, H, V), cu


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_varlen_call_makes_no_host_sync(mode):
    """Offsets on the device: a warmed forward and backward with cu_seqlens never wait for
    the GPU (torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call)."""
    leaves, do, cu = _packed_leaves((5, 0, 130, 64))

    def call():
        o, s = torch_side.recurrent_gla(*leaves, cu_seqlens=cu, platform="triton", mode=mode)
        return torch.autograd.grad((o, s), leaves, (do, torch.ones_like(s)))

    want = call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(got, want):  # the same call (bf16; atomics may reorder sums)
        assert rel_err(a.float().cpu().numpy(), b.float().cpu().numpy()) < 1e-2


def test_bad_offsets_on_cuda_fail_at_the_next_sync():
    """Offsets that do not end at the token count, on the device: the contract's
    device-side check fails the process's next synchronizing call (a device-side assert
    poisons the CUDA context, hence a process of its own)."""
    script = (
        "import torch, torch_side\n"
        "q = torch.randn(1, 20, 2, 16, device='cuda')\n"
        "cu = torch.tensor([0, 5, 21], device='cuda')\n"
        "try:\n"
        "    torch_side.recurrent_gla(q, q, q, cu_seqlens=cu, platform='triton',\n"
        "                             mode='fused_recurrent')\n"
        "    torch.cuda.synchronize()\n"
        "except RuntimeError as e:\n"
        "    print('FAILED AT SYNC:', 'device-side assert' in str(e))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert "FAILED AT SYNC: True" in out.stdout, out.stdout + out.stderr[-2000:]
