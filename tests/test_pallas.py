"""The Pallas path (jax_side/pallas.py) in interpret mode against the float64 NumPy
oracle: outputs, final states and every gradient, per SPEC feature, over several
64-token chunks and packed sequences. Transformations, the XLA path and the TPU
lowering: test_pallas_transforms.py; the public functions exported for a TPU:
test_pallas_tpu.py."""

from functools import partial

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from jax_cases import errors  # noqa: E402
from parity import cases  # noqa: E402
from parity.compare import TOLERANCE  # noqa: E402

C = partial(cases.Case, B=2)
STRONG = (5.0, 10.0)  # log decays in [-10, -5] a step

FEATURES = [  # every sequence crosses 64-token chunks
    C("plain", T=129),
    C("g-head", g="head", T=200),
    C("g-key-gk-gv", g="key", gk=True, gv=True, T=150),
    C("reverse-all", g="key", gk=True, gv=True, g_gamma="head", initial_state=True, T=140,
      reverse=True),
    C("gqa-k-ne-v", H=4, Hk=2, K=7, V=12, g="head", gv=True, initial_state=True, T=129),
    C("strong", g="key", gv=True, g_gamma="head", initial_state=True, gate_range=STRONG,
      T=130),
    C("strong-head-rev", g="head", initial_state=True, gate_range=STRONG, T=137, reverse=True),
    # K = 1: one key-side gate per token, but with gv the key-wise kernels (was: gv dropped)
    C("k1-gk-gv", K=1, V=1, gk=True, gv=True, T=65, reverse=True),
]


MULTI = [  # more chunks, varlen across them, bf16: (case, dtype)
    (cases.Case("T300-gk-bf16", T=300, gk=True, initial_state=True, K=16, V=16),
     jnp.bfloat16),
    (cases.Case("varlen-0-70-130-strong", seqlens=(0, 70, 130), g="key", gv=True,
                g_gamma="seq", initial_state=True, gate_range=STRONG), jnp.float32),
    (cases.Case("varlen-0-70-130-bf16-rev", seqlens=(0, 70, 130), H=4, Hk=2, g="head",
                g_gamma="head", initial_state=True, reverse=True), jnp.bfloat16),
]


def assert_matches_oracle(case, dtype=jnp.float32):
    errs = errors(case, dtype)
    assert max(errs.values()) <= TOLERANCE[str(jnp.dtype(dtype))], errs


@pytest.mark.parametrize("case, dtype", MULTI, ids=[c.name for c, _ in MULTI])
def test_multi_chunk_matches_oracle(case, dtype):
    """Chunk-to-chunk state passing, sub-chunk reference points and the chunk-local
    gate-gradient sums over 3-5 chunks, fp32 and bf16."""
    assert_matches_oracle(case, dtype)


@pytest.mark.parametrize("case", FEATURES, ids=lambda c: c.name)
def test_feature_matches_oracle(case):
    assert_matches_oracle(case)


VARLEN = (21, 0, 5, 16, 1, 19)  # ends mid-chunk, an empty sequence, exactly one chunk


@pytest.mark.parametrize("case", [
    cases.Case("everything-rev", seqlens=VARLEN, H=4, Hk=1, g="head", gk=True, gv=True,
               g_gamma="seq", initial_state=True, reverse=True),
    cases.Case("strong-gamma-seq", seqlens=VARLEN, g_gamma="seq", gv=True,
               initial_state=True, gate_range=STRONG, K=5, V=9),
], ids=lambda c: c.name)
def test_varlen_matches_oracle(case):
    assert_matches_oracle(case)


def test_varlen_trailing_empty_sequences():
    """Empty sequences at the end (unused chunk slots inherit the last real one)."""
    assert_matches_oracle(cases.Case(seqlens=(0, 18, 0, 0), g="key", gv=True,
                                     initial_state=True))
