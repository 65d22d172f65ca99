"""bridge.kernels.interpreter: Triton's interpreter computes tl.dot correctly.

A small kernel loads [M,K] and [K,N] tiles and stores tl.dot in fp32; the
result is compared with a float64 matmul of the very same (rounded) operands.
Products of bf16/fp16 values are exact in fp32, so the only error allowed is
fp32 accumulation rounding: |err| <= 1e-5 * (|A| @ |B| + |acc|) elementwise.

Without the shim, interpreted bf16 dots multiply raw uint16 bit patterns
(triton issue 11584); test_bf16_dot_is_broken_without_the_shim keeps that
visible. Only meaningful where the interpreter runs (skipped on a GPU).
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import bridge.kernels  # noqa: E402  (decides the interpreter before triton is imported)

pytest.importorskip("triton")
from bridge.kernels import interpreter  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(not bridge.kernels.INTERPRETED,
                                reason="Triton interpreter not active")

SHAPES = [(16, 16, 16), (32, 32, 32), (64, 64, 64), (16, 64, 32)]  # (M, K, N); last one non-square
DTYPES = ["bfloat16", "float16", "float32"]
REL = 1e-5


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                MODE: tl.constexpr):
    rm = tl.arange(0, M)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    mn = rm[:, None] * N + rn[None, :]
    if MODE == "plain":  # fp32 accumulator created by tl.dot, default input precision
        out = tl.dot(a, b)
    elif MODE == "acc":  # explicit fp32 accumulator
        acc = tl.load(c_ptr + mn)
        out = tl.dot(a, b, acc)
    elif MODE == "tf32":
        out = tl.dot(a, b, input_precision="tf32")
    elif MODE == "ieee":
        out = tl.dot(a, b, input_precision="ieee")
    else:  # "fp16out": fp16 operands, fp16 result
        out = tl.dot(a, b, out_dtype=tl.float16).to(tl.float32)
    tl.store(out_ptr + mn, out)


def _run(dtype, shape, mode, seed=0):
    """(result, float64 reference, elementwise error bound scale) as float64."""
    m, k, n = shape
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(getattr(torch, dtype))
    b = torch.randn(k, n, generator=g).to(getattr(torch, dtype))
    c = torch.randn(m, n, generator=g) if mode == "acc" else torch.zeros(m, n)
    out = torch.empty(m, n, dtype=torch.float32)
    _dot_kernel[(1,)](a, b, c, out, m, k, n, mode)
    a64, b64, c64 = a.double(), b.double(), c.double()
    ref = a64 @ b64 + c64
    scale = a64.abs() @ b64.abs() + c64.abs()
    return out.double(), ref, scale


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["plain", "acc"])
def test_dot_matches_float64(dtype, shape, mode):
    got, ref, scale = _run(dtype, shape, mode)
    assert torch.all((got - ref).abs() <= REL * scale), (got - ref).abs().max().item()


@pytest.mark.parametrize("mode", ["tf32", "ieee"])
def test_fp32_precision_is_exact_fp32(mode):
    """The interpreter ignores input_precision: even "tf32" is a full fp32 product
    (a tf32-rounded product would miss this 1e-5 bound by orders of magnitude)."""
    got, ref, scale = _run("float32", (32, 64, 16), mode)
    assert torch.all((got - ref).abs() <= REL * scale)


def test_fp16_out_dtype_rounds_to_fp16():
    got, ref, scale = _run("float16", (32, 64, 16), "fp16out")
    err = ((got - ref).abs() / scale).max().item()
    assert err <= 2e-3  # fp16 result rounding (eps 2**-11 ~ 4.9e-4), nothing like 1e10
    assert torch.equal(got, got.half().double())  # the result really was rounded to fp16


def test_bf16_dot_is_broken_without_the_shim():
    """Triton's own create_dot (restored for this test only) gets bf16 wrong;
    if this starts failing, upstream fixed issue 11584 and the shim may go."""
    assert interpreter.installed()
    interpreter.uninstall()
    try:
        assert not interpreter.installed()
        got, ref, _ = _run("bfloat16", (16, 16, 16), "plain")
    finally:
        assert interpreter.install()
    assert (got - ref).abs().max().item() > 1e6  # uint16 bit patterns multiplied: ~1e10
    got, ref, scale = _run("bfloat16", (16, 16, 16), "plain")
    assert torch.all((got - ref).abs() <= REL * scale)


def test_install_is_idempotent():
    import triton.runtime.interpreter as interp

    assert interpreter.install()
    patched = interp.InterpreterBuilder.create_dot
    for _ in range(3):
        assert interpreter.install()
    assert interp.InterpreterBuilder.create_dot is patched
    assert not getattr(patched.__wrapped__, interpreter._MARK, False)  # wrapped exactly once
    got, ref, scale = _run("bfloat16", (16, 16, 16), "acc")
    assert torch.all((got - ref).abs() <= REL * scale)


def test_install_fails_loudly_without_the_hook(monkeypatch):
    import triton.runtime.interpreter as interp

    interpreter.uninstall()
    try:
        monkeypatch.delattr(interp.InterpreterBuilder, "create_dot")
        with pytest.raises(RuntimeError, match=f"Triton {triton.__version__}.*create_dot"):
            interpreter.install()

        def create_dot(self, lhs, rhs, d, input_precision, max_num_imprecise_acc):
            raise AssertionError("never called")

        monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot, raising=False)
        with pytest.raises(RuntimeError, match=triton.__version__):
            interpreter.install()
        assert not interpreter.installed()
    finally:
        monkeypatch.undo()
        assert interpreter.install()


def test_install_does_nothing_when_not_interpreting():
    code = ("import sys; from bridge.kernels import interpreter as i; "
            "assert i.install() is False; assert 'triton' not in sys.modules; print('ok')")
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
