"""The compiled kernels on a CUDA GPU (the GPU owner's suite: README, "On a GPU").

Every test here launches the kernels compiled for the device, from PyTorch and
from JAX (jax-triton), and compares them with the float64 oracle (run on the
host), with each other, and across the two kernel families. Without a CUDA
device they are skipped: the rest of the suite runs the same kernel source in
Triton's interpreter.
"""

import importlib.util

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
CASES = [
    cases.Case("gla-chunks", B=2, T=300, H=4, Hk=2, K=64, V=64, g="key", initial_state=True),
    cases.Case("every-gate-varlen", H=2, Hk=1, K=128, V=96, seqlens=(0, 70, 130, 1),
               g="head", gk=True, gv=True, g_gamma="seq", initial_state=True, reverse=True,
               packed=True),
    cases.Case("strong", T=200, H=2, Hk=2, K=32, V=32, g="key", gv=True, gate_scale=10.0,
               gate_grad_floor=0.1),
]


def test_compiled_not_interpreted():
    assert not bridge.kernels.INTERPRETED


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_launch_matches_oracle(case, mode, dtype):
    arrays = backends.prepared(case, dtype)
    got = backends.TorchBackend("triton", mode).run(case, arrays, dtype)
    errs = errors(got, ORACLE.run(case, arrays, dtype), case.gate_grad_floor)
    assert max(errs.values()) <= tolerance(dtype), errs


@pytest.mark.skipif(importlib.util.find_spec("jax_triton") is None,
                    reason="jax-triton is not installed: JAX cannot launch Triton kernels on CUDA")
@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
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
        assert rel_err(a.detach().float().cpu().numpy(), b.detach().float().cpu().numpy()) < 3e-2, name


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
