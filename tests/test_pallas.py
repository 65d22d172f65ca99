"""The Pallas path (jax_side/pallas.py) in interpret mode against the float64
NumPy oracle: outputs, final states and every gradient, per SPEC feature, over
several 64-token chunks and packed sequences. Transformations, the XLA path and
the TPU lowering: test_pallas_transforms.py; the public functions exported for a
TPU: test_pallas_tpu.py."""

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from jax_cases import errors, make  # noqa: E402
from parity.compare import TOLERANCE  # noqa: E402


FEATURES = {  # name: (make() arguments, reverse); every sequence crosses 64-token chunks
    "plain": (dict(T=129), False),
    "g-head": (dict(g="head", T=200), False),
    "g-key-gk-gv": (dict(g="key", gk=True, gv=True, T=150), False),
    "reverse-all": (dict(g="key", gk=True, gv=True, gamma="head", h0=True, T=140), True),
    "gqa-k-ne-v": (dict(H=4, Hk=2, K=7, V=12, g="head", gv=True, h0=True, T=129), False),
    "strong": (dict(g="key", gv=True, gamma="head", h0=True, strong=True, T=130), False),
    "strong-head-rev": (dict(g="head", h0=True, strong=True, T=137), True),
    # K = 1: one key-side gate per token, but with gv the key-wise kernels (was: gv dropped)
    "k1-gk-gv": (dict(K=1, V=1, gk=True, gv=True, T=65), True),
}


MULTI = {  # more chunks, varlen across them, bf16: (make() arguments, reverse, dtype)
    "T300-gk-bf16": (dict(B=1, T=300, gk=True, h0=True, K=16, V=16), False, jnp.bfloat16),
    "varlen-0-70-130-strong": (dict(seqlens=(0, 70, 130), g="key", gv=True, gamma="seq",
                                    h0=True, strong=True), False, jnp.float32),
    "varlen-0-70-130-bf16-rev": (dict(seqlens=(0, 70, 130), H=4, Hk=2, g="head", gamma="head",
                                      h0=True), True, jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(MULTI))
def test_multi_chunk_matches_oracle(name):
    """Chunk-to-chunk state passing, sub-chunk reference points and the chunk-local
    gate-gradient sums over 3-5 chunks, fp32 and bf16."""
    kw, reverse, dtype = MULTI[name]
    x, cu, cot = make(**kw)
    errs = errors(x, cu, reverse, cot, dtype=dtype)
    assert max(errs.values()) <= TOLERANCE[str(jnp.dtype(dtype))], errs


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_matches_oracle(name):
    kw, reverse = FEATURES[name]
    x, cu, cot = make(**kw)
    errs = errors(x, cu, reverse, cot)
    assert max(errs.values()) <= TOLERANCE["float32"], errs


VARLEN = (21, 0, 5, 16, 1, 19)  # ends mid-chunk, an empty sequence, exactly one chunk


@pytest.mark.parametrize("kw, reverse", [
    (dict(H=4, Hk=1, g="head", gk=True, gv=True, gamma="seq", h0=True), True),
    (dict(gamma="seq", gv=True, h0=True, strong=True, K=5, V=9), False),
], ids=["everything-rev", "strong-gamma-seq"])
def test_varlen_matches_oracle(kw, reverse):
    x, cu, cot = make(seqlens=VARLEN, **kw)
    errs = errors(x, cu, reverse, cot)
    assert max(errs.values()) <= TOLERANCE["float32"], errs


def test_varlen_trailing_empty_sequences():
    """Empty sequences at the end (unused chunk slots inherit the last real one)."""
    x, cu, cot = make(seqlens=(0, 18, 0, 0), g="key", gv=True, h0=True)
    errs = errors(x, cu, False, cot)
    assert max(errs.values()) <= TOLERANCE["float32"], errs
