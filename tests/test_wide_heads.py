"""Head dims past 256 (issue 43 item 4): the Triton families (chunk, fused_recurrent at
K, V up to 512; fused_chunk at K up to 512, its K split over programs) with odd sizes
among them (masked blocks), against the float64 oracle, values and gradients, fp32 and
bf16; and dispatch: "auto" never picks a family or platform that refuses the call's head
dims (bridge.dispatch.HEAD_DIMS), a named one refuses before any kernel.

The interpreter runs these (one or two chunks, one or two heads: 5-14 s a case on this
2-core machine)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch_side  # noqa: E402  (decides the interpreter before triton is imported)
from bridge import contract, dispatch  # noqa: E402
from parity import cases, oracle  # noqa: E402
from parity.compare import assert_close, rel_err  # noqa: E402

import test_triton_chunk  # noqa: E402
import test_triton_fused  # noqa: E402
import test_triton_fused_chunk  # noqa: E402

C = cases.Case
RUN = {"chunk": test_triton_chunk.run_case, "fused_recurrent": test_triton_fused.run_case,
       "fused_chunk": lambda case, dtype: test_triton_fused_chunk.run_case(case, dtype,
                                                                           backward=True)}

# (family, dtype, case): K and V past 256, powers of two and not (300, 260, 320: the last
# K / V block masked); fp32 takes the chunk family's smallest blocks, so the most programs
WIDE = [
    ("chunk", "float32", C("k300-v260-key", T=12, H=1, Hk=1, K=300, V=260, g="key")),
    ("chunk", "bfloat16", C("k512-v512-gk", T=12, H=1, Hk=1, K=512, V=512, gk=True)),
    ("chunk", "bfloat16", C("k320-v260-key-gv-gamma-h0", T=12, H=1, Hk=1, K=320, V=260,
                            g="key", gv=True, g_gamma="head", initial_state=True)),
    ("fused_recurrent", "float32", C("k512-v512-key-gv-h0", T=12, H=1, Hk=1, K=512, V=512,
                                     g="key", gv=True, initial_state=True)),
    ("fused_recurrent", "bfloat16", C("k300-v260-all", T=12, H=1, Hk=1, K=300, V=260,
                                      g="key", gv=True, g_gamma="head", initial_state=True)),
    # fused_chunk's K blocks of 64 (the last one masked at 260 and 300), the backward
    # through the chunk family's list; two chunks where the state crosses a chunk
    ("fused_chunk", "float32", C("k300-gk-h0", T=12, H=1, Hk=1, K=300, V=20, gk=True,
                                 initial_state=True)),
    ("fused_chunk", "bfloat16", C("k512-g-head-gamma-gqa", T=40, H=2, Hk=1, K=512, V=24,
                                  g="head", g_gamma="head", initial_state=True)),
    ("fused_chunk", "float32", C("k260-key-gv-varlen-reverse", H=1, Hk=1, K=260, V=16,
                                 g="key", gv=True, seqlens=(7, 0, 33), reverse=True)),
    # 16 bits with gv: V blocks of 16, K blocks of 64 in bf16 and 32 in fp16
    # (fused_chunk.config), their partial outputs summed in fp32
    ("fused_chunk", "bfloat16", C("k320-key-gv-h0", T=40, H=1, Hk=1, K=320, V=24, g="key",
                                  gv=True, initial_state=True)),
    ("fused_chunk", "float16", C("k300-head-gv-gqa", T=12, H=2, Hk=1, K=300, V=20, g="head",
                                 gv=True)),
]


@pytest.mark.parametrize("family,dtype,case", WIDE,
                         ids=[f"{f}-{d}-{c.name}" for f, d, c in WIDE])
def test_wide_heads_match_the_oracle(family, dtype, case):
    assert_close(RUN[family](case, dtype), dtype)


def _arrays(K, V, T=3):
    rng = np.random.default_rng(0)
    return dict(q=rng.standard_normal((1, T, 2, K)).astype(np.float32),
                k=rng.standard_normal((1, T, 2, K)).astype(np.float32),
                v=rng.standard_normal((1, T, 2, V)).astype(np.float32),
                g=-rng.random((1, T, 2, K)).astype(np.float32))


def _prepare(K, V, platform, mode, gpu=True, T=3):
    return dispatch.prepare(_arrays(K, V, T), softmax_scale=None, reverse=False,
                            cu_seqlens=None, platform=platform, mode=mode,
                            platforms=("auto", "triton", "torch"), fallback="torch", gpu=gpu)


@pytest.mark.parametrize("K,V", [(513, 8), (8, 600), (1024, 1024)])
@pytest.mark.parametrize("mode", ["auto", "chunk"])
def test_auto_platform_goes_where_the_head_dims_run(K, V, mode):
    """Past both Triton families' limits on a GPU, platform="auto" takes the framework's
    own chunked path (which runs any head dims: checked against the oracle below);
    within them, the Triton kernels."""
    call = _prepare(K, V, "auto", mode)
    assert (call.platform, call.kernel) == ("torch", "torch")
    assert _prepare(512, 512, "auto", mode).platform == "triton"


@pytest.mark.parametrize("platform,mode,want", [
    ("triton", "auto", "^q: mode='fused_recurrent' supports K <= 512, got K=513"),
    ("triton", "chunk", "^q: mode='chunk' supports K <= 512, got K=513"),
    ("auto", "fused_recurrent", "^q: mode='fused_recurrent' supports K <= 512, got K=513"),
    ("auto", "fused_chunk", "^q: mode='fused_chunk' supports K <= 512, got K=513"),
])
def test_named_triton_paths_refuse_before_any_kernel(platform, mode, want):
    """A platform or family the caller named refuses past its limit in dispatch, before any
    launch is planned, saying what runs the call instead."""
    with pytest.raises(ValueError, match=want) as err:
        _prepare(513, 8, platform, mode)
    assert "platform='auto' or 'torch'" in str(err.value)
    with pytest.raises(ValueError, match="^v: mode='chunk' supports V <= 512, got V=513"):
        _prepare(8, 513, "triton", "chunk")


def test_fused_chunk_limit_is_512():
    """fused_chunk takes K and V up to 512 as the others do (K past 256 through its K
    split); 513 is refused (V: its backward there would be the chunk family's, which
    refuses it)."""
    for K in (257, 300, 512):
        assert dispatch.refusal(contract.check(**_arrays(K, 8)), "fused_chunk") is None
    assert dispatch.refusal(contract.check(**_arrays(513, 8)), "fused_chunk") is not None
    assert dispatch.refusal(contract.check(**_arrays(512, 512)), "fused_chunk") is None
    assert dispatch.refusal(contract.check(**_arrays(8, 513)), "fused_chunk").startswith("v:")


def test_auto_family_skips_one_that_refuses(monkeypatch):
    """mode="auto" picks the cheaper family among those that take the head dims: at T = 3
    the fused kernel is cheaper, but with it limited to K <= 256 the chunked one runs."""
    plan = contract.check(**_arrays(300, 8))
    assert dispatch.kernel_mode("auto", plan) == "fused_recurrent"
    monkeypatch.setitem(dispatch.HEAD_DIMS, "fused_recurrent", (256, 256))
    assert dispatch.kernel_mode("auto", plan) == "chunk"
    assert _prepare(300, 8, "triton", "auto").kernel == "chunk"


def test_fallback_runs_heads_past_the_triton_limit():
    """The path "auto" falls back to (torch's chunked ops) at K = 600, V = 520 against the
    float64 oracle."""
    a = _arrays(600, 520, T=5)
    o, s = torch_side.recurrent(*(torch.from_numpy(a[n]) for n in ("q", "k", "v")),
                                gk=torch.from_numpy(a["g"]), platform="torch")
    want_o, want_s = oracle.recurrent(a["q"], a["k"], a["v"], gk=a["g"])
    assert rel_err(o.numpy(), want_o) < 1e-5 and rel_err(s.numpy(), want_s) < 1e-5
