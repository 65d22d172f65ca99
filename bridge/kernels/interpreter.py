"""The one shim for Triton interpreter bugs (TRITON_INTERPRET=1 only).

Kernels are the same source interpreted or compiled; where Triton's CPU
interpreter computes something wrongly, the fix lives here and patches the
interpreter itself, never a second kernel path.

bf16 `tl.dot` (Triton 3.7.1, upstream issue 11584)
    The interpreter stores bf16 blocks as their raw uint16 bit patterns, and
    `InterpreterBuilder.create_dot` (triton/runtime/interpreter.py) hands them
    to `np.matmul(a, b, dtype=float32)`, which multiplies the integers: errors
    of 1e10. `install()` wraps `create_dot` so that bf16 operands are widened
    to float32 first (exactly: the bf16 bits are the high half of the fp32
    bits). Products of bf16 values are exact in fp32, and the accumulator and
    result keep the dtype the kernel asked for, so the result differs from a
    float64 matmul only by fp32 accumulation rounding.

Scalars as indices (Triton 3.6 with NumPy >= 2.4)
    The interpreter holds a scalar as a one-element 1-d array, and Triton 3.6's
    `_patch_lang_tensor` gives tensors `__index__ = int(self.handle.data)`, which
    NumPy 2.4 refuses for arrays of ndim > 0: every `range(0, n)` on a loaded
    bound fails. `install()` wraps `_patch_lang_tensor` so that `__index__`
    reads the one element (what Triton 3.7 does itself).

bf16 scalar constants (Triton 3.6 and 3.7)
    A Python float meeting a bf16 tensor (`tl.where(a < c, c, a)` on bf16 gates) becomes
    a bf16 constant through `InterpreterBuilder.get_bf16`, which the interpreter lacks.
    `install()` adds it: the float32 constant cast to bf16 by the interpreter's own cast.

Other dot precisions, as the interpreter computes them (unpatched)
    fp32 operands: `input_precision` ("tf32", "tf32x3", "ieee"; the default
    is "tf32") is ignored; the product is an exact fp32 matmul (NumPy's
    sgemm). No tf32 rounding is emulated, so interpreted fp32 dots are *more*
    accurate than compiled tf32 ones.
    fp16 operands: with an fp32 accumulator, NumPy widens them to fp32 (exact
    products, fp32 accumulation); with `out_dtype=tl.float16` the result is
    rounded to fp16 as the kernel asks. Both are correct; not patched.
"""

from __future__ import annotations

import importlib.util
import os

_MARK = "_gla_bridge_bf16_dot_shim"
_original_create_dot = None  # Triton's own create_dot, kept for uninstall()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_version() -> str:
    try:
        import triton

        return getattr(triton, "__version__", "unknown")
    except Exception:  # pragma: no cover - triton missing altogether
        return "not importable"


def _fail(why: str):
    raise RuntimeError(
        f"bridge.kernels.interpreter: cannot install the bf16 tl.dot fix into Triton "
        f"{_triton_version()}'s interpreter: {why}. Without it, interpreted bf16 tl.dot "
        f"results are garbage (triton issue 11584); update bridge/kernels/interpreter.py "
        f"for this Triton version."
    )


def _widen_bf16(handle, interp, tl):
    """A float32 TensorHandle with the values of a bf16 one; others unchanged."""
    if handle.get_element_ty() != tl.bfloat16:
        return handle
    np = interp.np
    data = handle.data
    if data.dtype == np.uint16:  # raw bit patterns (3.7.1): exact widening by shift
        wide = (data.astype(np.uint32) << 16).view(np.float32)
    elif data.dtype.kind == "f" or data.dtype.name == "bfloat16":  # a real float storage
        wide = data.astype(np.float32)
    else:
        _fail(f"bf16 blocks are stored as NumPy {data.dtype}, expected uint16")
    return interp.TensorHandle(wide, tl.float32)


def _make_create_dot(original, interp, tl):
    def create_dot(self, a, b, *args, **kwargs):
        return original(self, _widen_bf16(a, interp, tl), _widen_bf16(b, interp, tl), *args,
                        **kwargs)

    create_dot.__doc__ = ("Triton's create_dot with bf16 operands widened to fp32 "
                          "(bridge.kernels.interpreter).")
    create_dot.__wrapped__ = original
    setattr(create_dot, _MARK, True)
    return create_dot


def _install_index_fix(interp) -> None:
    """Wrap `_patch_lang_tensor` so a scalar tensor's `__index__` reads its one element."""
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:
        _fail("triton.runtime.interpreter has no `_patch_lang_tensor`")
    if getattr(original, _MARK, False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    setattr(patch_lang_tensor, _MARK, True)
    interp._patch_lang_tensor = patch_lang_tensor


def _install_bf16_constant(interp, tl) -> None:
    """Give the interpreter's builder the `get_bf16` it lacks (see the module doc)."""
    builder_cls = interp.InterpreterBuilder
    if hasattr(builder_cls, "get_bf16"):
        return

    def get_bf16(self, value):
        return self.cast_impl(self.get_fp32(value), tl.bfloat16)

    builder_cls.get_bf16 = get_bf16


def _self_check(interp, tl):
    """A 1x2 @ 2x1 bf16 dot through the patched builder: 1.5*2 + (-0.25)*4 = 2."""
    np = interp.np
    bits = lambda x: (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    a = interp.TensorHandle(bits([[1.5, -0.25]]), tl.bfloat16)
    b = interp.TensorHandle(bits([[2.0], [4.0]]), tl.bfloat16)
    d = interp.TensorHandle(np.zeros((1, 1), np.float32), tl.float32)
    out = interp.interpreter_builder.create_dot(a, b, d, None, 0)
    if out.data.dtype != np.float32 or float(out.data[0, 0]) != 2.0:
        _fail(f"the patched create_dot returned {out.data!r} for a bf16 dot that should be 2.0")


def install() -> bool:
    """Patch Triton's interpreter so that bf16 `tl.dot` is computed correctly, scalar
    tensors index and bf16 constants exist (see the module doc).

    Returns True if the fix is in place (now or from an earlier call), False
    when the interpreter is not active (TRITON_INTERPRET != "1") or Triton
    is not installed, in which case nothing is imported or touched.
    Idempotent. Raises RuntimeError,
    naming the Triton version, if the hook point is not where expected."""
    global _original_create_dot
    if not _interpreting() or importlib.util.find_spec("triton") is None:
        return False
    import triton.language as tl

    try:
        import triton.runtime.interpreter as interp
    except Exception as exc:
        _fail(f"triton.runtime.interpreter does not import ({exc!r})")
    for name in ("InterpreterBuilder", "TensorHandle", "interpreter_builder", "np"):
        if not hasattr(interp, name):
            _fail(f"triton.runtime.interpreter has no `{name}`")
    builder_cls = interp.InterpreterBuilder
    current = builder_cls.__dict__.get("create_dot")
    if not callable(current):
        _fail("InterpreterBuilder has no create_dot method")
    if "create_dot" in vars(interp.interpreter_builder):
        _fail("interpreter_builder overrides create_dot on the instance")
    _install_index_fix(interp)
    _install_bf16_constant(interp, tl)
    if getattr(current, _MARK, False):
        return True
    code = getattr(current, "__code__", None)
    if code is None or code.co_varnames[:3] != ("self", "a", "b"):
        _fail("InterpreterBuilder.create_dot no longer takes (self, a, b, ...)")
    builder_cls.create_dot = _make_create_dot(current, interp, tl)
    _original_create_dot = current
    try:
        _self_check(interp, tl)
    except Exception:
        builder_cls.create_dot = current
        _original_create_dot = None
        raise
    return True


def installed() -> bool:
    """Whether the interpreter's create_dot carries the fix (imports nothing)."""
    import sys

    interp = sys.modules.get("triton.runtime.interpreter")
    if interp is None:
        return False
    return getattr(interp.InterpreterBuilder.__dict__.get("create_dot"), _MARK, False)


def uninstall() -> None:
    """Restore Triton's own create_dot. For tests that show the bug exists."""
    global _original_create_dot
    if _original_create_dot is None:
        return
    import triton.runtime.interpreter as interp

    interp.InterpreterBuilder.create_dot = _original_create_dot
    _original_create_dot = None
