"""The values a kernel's skeleton (parity.compiled.tripcounts) computes with: Python
ints where the launch fixes them, `UNKNOWN` for whatever depends on memory (it absorbs
every operation), `Typed` unknowns that keep a tensor's or pointer's Triton dtype, and
the stand-ins for `triton` / `triton.language` the skeleton runs against (`FakeTL`:
program ids, grid sizes, cdiv and min/max on ints, loads, casts and dots keeping
dtypes, every other `tl` call unknown)."""

import triton.language as _tl

class Underivable(Exception):
    """A branch or loop bound depends on a value the skeleton cannot know."""


class Unknown:
    """A tensor, pointer or loaded value: every operation on it gives itself."""

    def __repr__(self):
        return "UNKNOWN"

    def __bool__(self):
        raise Underivable("condition on a runtime value")

    def __index__(self):
        raise Underivable("loop bound from a runtime value")

    def __getattr__(self, name):
        return self

    def __call__(self, *a, **k):
        return self

    def __getitem__(self, item):
        return self

    def __iter__(self):
        raise Underivable("iterating a runtime value")


UNKNOWN = Unknown()


def _absorb(name):
    def op(self, *other):
        return UNKNOWN
    op.__name__ = name
    return op


for _n in ("add sub mul truediv floordiv mod pow lshift rshift and or xor matmul "
           "radd rsub rmul rtruediv rfloordiv rmod rpow rlshift rrshift rand ror rxor "
           "lt le gt ge eq ne neg pos invert abs").split():
    setattr(Unknown, f"__{_n}__", _absorb(f"__{_n}__"))
Unknown.__hash__ = object.__hash__


class Typed(Unknown):
    """A tensor or pointer of known dtype (`dtype`: a `tl.dtype`, `tl.pointer_type`
    for a pointer): its values stay unknown, its dtype is read by dtype branches."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __repr__(self):
        return f"UNKNOWN[{self.dtype}]"


def _typed_op(name):
    def op(self, *other):
        if isinstance(self.dtype, _tl.pointer_type):  # an offset added keeps the pointer
            return self if name in ("__add__", "__radd__", "__sub__") else UNKNOWN
        # a tile keeps its dtype with a Python scalar or a tile of that dtype
        o = other[0] if other else None
        same = o is None or isinstance(o, (bool, int, float)) or (
            isinstance(o, Typed) and o.dtype == self.dtype)
        return self if same else UNKNOWN
    op.__name__ = name
    return op


for _n in ("add sub mul truediv radd rsub rmul rtruediv neg").split():
    setattr(Typed, f"__{_n}__", _typed_op(f"__{_n}__"))
Typed.__hash__ = object.__hash__


def pointer(dtype) -> Typed:
    """A tensor argument for `trip_counts`: a pointer to `dtype` (a `tl.dtype` or
    its name: 'bfloat16' or 'bf16', 'float32' or 'fp32', ...)."""
    if isinstance(dtype, str):
        dtype = getattr(_tl, _LONG.get(dtype, dtype))
    return Typed(_tl.pointer_type(dtype))


_LONG = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
         "i32": "int32", "i64": "int64", "i8": "int8"}


def typed(dtype):
    dtype = unwrap(dtype)
    return Typed(dtype) if isinstance(dtype, _tl.dtype) else UNKNOWN


def known(*xs):
    return not any(isinstance(x, Unknown) for x in xs)


def unwrap(x):
    return getattr(x, "value", x) if type(x).__name__ == "constexpr" else x


class FakeTL:
    """`triton.language` for the skeleton: scalar program ids, cdiv, min/max,
    where on scalars, the loop ranges; everything else yields UNKNOWN."""

    def __init__(self, run):
        self._run = run

    def program_id(self, axis=0):
        return self._run.pid[unwrap(axis)]

    def num_programs(self, axis=0):
        return self._run.grid[unwrap(axis)]

    @staticmethod
    def cdiv(a, b):
        a, b = unwrap(a), unwrap(b)
        return -(-a // b) if known(a, b) else UNKNOWN

    @staticmethod
    def minimum(a, b, *_, **__):
        return min(a, b) if known(a, b) else UNKNOWN

    @staticmethod
    def maximum(a, b, *_, **__):
        return max(a, b) if known(a, b) else UNKNOWN

    @staticmethod
    def where(c, a, b):
        if not known(c, a, b) or not isinstance(c, (bool, int)):
            return UNKNOWN
        return a if c else b

    @staticmethod
    def multiple_of(x, *_):
        return x

    max_contiguous = max_constancy = multiple_of

    @staticmethod
    def range(*args, **_):
        return loop_range(*args)

    @staticmethod
    def load(ptr, *_, **__):
        t = getattr(ptr, "dtype", None) if isinstance(ptr, Typed) else None
        return Typed(t.element_ty) if isinstance(t, _tl.pointer_type) else UNKNOWN

    @staticmethod
    def zeros(shape, dtype=None):
        return typed(dtype)

    @staticmethod
    def full(shape, value, dtype=None):
        return typed(dtype)

    @staticmethod
    def dot(a, b, acc=None, *_, out_dtype=_tl.float32, **__):
        return acc if isinstance(acc, Typed) else typed(out_dtype)

    static_range = range

    @staticmethod
    def constexpr(x=None):
        return unwrap(x)

    def __getattr__(self, name):
        real = getattr(_tl, name, None)
        return real if isinstance(real, _tl.dtype) else UNKNOWN


class FakeTriton:
    cdiv = staticmethod(FakeTL.cdiv)

    def __init__(self, tl):
        self.language = tl

    def __getattr__(self, name):
        return UNKNOWN


def loop_range(*args):
    args = [unwrap(a) for a in args]
    if not known(*args) or not all(isinstance(a, int) for a in args):
        raise Underivable("range() of a runtime value")
    return range(*args)


def typed_to(x, dtype=None, *_, **__):
    """`x.to(dtype)`: on a scalar the value itself (int32/int64 overflow ignored),
    on a tensor an unknown one of that dtype."""
    return typed(dtype) if isinstance(x, Unknown) else x
