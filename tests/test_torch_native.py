"""torch_side.native (the chunked torch path) against the float64 NumPy oracle:
outputs, final states and the gradient of every input, for each SPEC feature
alone and combined, in float64 / float32 / bf16 / fp16, plus gradcheck, strong
gates, slab-by-slab forward and backward, and memory bounds."""

import pytest
import torch
import torch.nn.functional as F

from bridge.contract import check
from parity import cases
from parity.compare import rel_err
from parity.bench.timing import peak_tensor_bytes
from parity.oracle import recurrent, recurrent_grads
from torch_side.native import NativeConfig, recurrent_native

def make(seed=0, B=2, T=37, H=2, Hk=None, K=8, V=6, g=None, gk=False, gv=False, g_gamma=None,
         initial_state=False, seqlens=None, gate=(-1.0, 0.0), dtype=torch.float64):
    """Inputs of `recurrent` drawn by `parity.cases`, as leaf tensors in `dtype` (batched
    layout; with seqlens B=1 and cu_seqlens). g: None | "key" | "head"; g_gamma: None |
    "head" ([H]) | "seq" ([N,H]); gate: the log-gate range of every gate, g_gamma too."""
    lo, hi = gate
    _, arrays = cases.make(seed, B=1 if seqlens else B, T=T, H=H, Hk=Hk or H, K=K, V=V,
                           g=g or "none", gk=gk, gv=gv, g_gamma=g_gamma or "none",
                           initial_state=initial_state, seqlens=seqlens,
                           gate_range=(-hi, -lo), gamma_range=(-hi, -lo))
    kw, _ = cases.split(arrays)
    cu = kw.pop("cu_seqlens", None)
    kw = {n: torch.from_numpy(a).to(dtype).requires_grad_() for n, a in kw.items()}
    return kw, None if cu is None else torch.from_numpy(cu)


def native_call(kw, cu=None, reverse=False, **extra):
    plan = check(**kw, reverse=reverse, cu_seqlens=cu)
    return recurrent_native(plan, kw["q"], kw["k"], kw["v"], g=kw.get("g"), gk=kw.get("gk"),
                            gv=kw.get("gv"), g_gamma=kw.get("g_gamma"),
                            initial_state=kw.get("initial_state"), cu_seqlens=cu, **extra)


def oracle_call(kw, cu=None, reverse=False, do=None, dfinal_state=None):
    """Oracle (o, final_state[, grads]) on the float64 values of the same tensors."""
    arrs = {n: x.detach().double().numpy() for n, x in kw.items()}
    cun = None if cu is None else cu.numpy()
    o, s = recurrent(**arrs, reverse=reverse, cu_seqlens=cun)
    if do is None:
        return o, s
    grads = recurrent_grads(**arrs, reverse=reverse, cu_seqlens=cun, do=do,
                            dfinal_state=dfinal_state)
    return o, s, grads


def rel(a, b):
    """rel_err of a tensor against an array (a floor of 1e-30: relative, also near 0)."""
    return rel_err(a.detach().double().numpy() if torch.is_tensor(a) else a, b, floor=1e-30)


def check_all(kw, cu=None, reverse=False, tol=1e-10, seed=0, **extra):
    """o, final_state and every input gradient (random do and dfinal_state) vs the oracle."""
    o, s = native_call(kw, cu, reverse, **extra)
    N, H, K, V = s.shape
    assert o.shape == kw["q"].shape[:-1] + (V,) and o.dtype == kw["q"].dtype
    want_state = torch.float64 if kw["q"].dtype == torch.float64 else torch.float32
    assert s.dtype == want_state
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    gen = torch.Generator().manual_seed(seed + 99)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(s.shape, generator=gen, dtype=torch.float64)
    ro, rs, rg = oracle_call(kw, cu, reverse, do.numpy(), ds.numpy())
    assert rel(o, ro) < tol, ("o", rel(o, ro))
    assert rel(s, rs) < tol, ("final_state", rel(s, rs))
    names = [n for n in cases.INPUTS if n in kw]
    loss = (o.double() * do).sum() + (s.double() * ds).sum()
    grads = torch.autograd.grad(loss, [kw[n] for n in names])
    for n, gr in zip(names, grads):
        assert gr.shape == kw[n].shape and gr.dtype == kw[n].dtype, n
        assert torch.isfinite(gr).all(), n
        assert rel(gr, rg[n]) < tol, (n, rel(gr, rg[n]))


# --- each feature alone, and combined (float64: exact up to rounding) ----------------------------

FEATURES = {
    "plain": dict(),
    "g-key": dict(g="key"),
    "g-head": dict(g="head"),
    "gk": dict(gk=True),
    "gv": dict(gv=True),
    "gamma-head": dict(g_gamma="head"),
    "gamma-seq": dict(g_gamma="seq", B=3),
    "initial-state": dict(initial_state=True, gk=True),
    "grouped-heads": dict(H=4, Hk=2, gk=True, gv=True),
    "grouped-one-kv-head": dict(H=3, Hk=1, g="head"),
    "k-ne-v-odd": dict(K=5, V=33, gk=True),
    "odd-33-5": dict(K=33, V=5, gv=True, g="key"),
    "long-not-multiple": dict(B=1, T=203, gk=True, initial_state=True),
    "whole-chunks": dict(B=2, T=128, H=3, g="key", gv=True, initial_state=True),
    "one-head-one-chunk": dict(B=1, T=64, H=1, gk=True, initial_state=True),
    "all-batched": dict(H=4, Hk=2, g="head", gk=True, gv=True, g_gamma="seq", initial_state=True),
    "all-key-forms": dict(g="key", gk=True, gv=True, g_gamma="head", initial_state=True, K=7, V=9),
}


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_float64(feature, reverse):
    kw, cu = make(seed=list(FEATURES).index(feature), **FEATURES[feature])
    check_all(kw, cu, reverse)


VARLEN = {
    # mid-chunk ends, a zero-length sequence, sequences shorter than a 16-block, one > 2 chunks
    "mixed": (5, 0, 70, 64, 1, 17, 130),
    "zero-first-last": (0, 3, 40, 0),
    "all-short": (1, 2, 3, 15, 16),
    "single": (77,),
}


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("lens", list(VARLEN))
def test_varlen_float64(lens, reverse):
    kw, cu = make(seed=7, seqlens=VARLEN[lens], H=4, Hk=2, g="head", gk=True, gv=True,
                  g_gamma="seq", initial_state=True)
    check_all(kw, cu, reverse)


def test_varlen_without_optional_inputs():
    kw, cu = make(seed=8, seqlens=(9, 0, 33), g_gamma="head")
    check_all(kw, cu)
    kw, cu = make(seed=9, seqlens=(0, 0))  # nothing to compute: zero outputs, zero states
    check_all(kw, cu)


def test_all_empty_keeps_initial_state():
    kw, cu = make(seed=10, seqlens=(0, 0, 0), initial_state=True, gk=True)
    o, s = native_call(kw, cu)
    assert o.shape == (1, 0, 2, 6)
    torch.testing.assert_close(s, kw["initial_state"].detach())
    s.sum().backward()
    torch.testing.assert_close(kw["initial_state"].grad, torch.ones_like(s))


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 32, 128])
def test_chunk_sizes(chunk_size):
    kw, cu = make(seed=11, seqlens=(40, 3, 90), gk=True, gv=True, g="head", initial_state=True)
    check_all(kw, cu, reverse=chunk_size == 32, chunk_size=chunk_size)


def test_chunk_size_must_be_a_power_of_two():
    kw, _ = make(seed=11, T=20)
    with pytest.raises(ValueError, match="chunk_size"):
        native_call(kw, chunk_size=48)


@pytest.mark.parametrize("limit", [0.0, 1.0, 4.0, 48.0])
def test_narrow_blocks(limit):
    """A small log_decay_limit forces narrower in-block widths (down to 1) and more levels;
    48 (key gates ~ -1 a token here) blocks wider than a triangle-piece but narrower than
    the chunk (32 of 64: one level)."""
    kw, cu = make(seed=12, T=100, g="key", gv=True, g_gamma="head", initial_state=True)
    check_all(kw, cu, reverse=limit == 1.0, config=NativeConfig(log_decay_limit=limit))


def test_scale_and_noncontiguous_inputs():
    kw, _ = make(seed=13, B=2, T=50, H=2, K=4, V=4, gk=True, initial_state=True)
    # same values, non-contiguous layouts
    relaid = lambda x: x.detach().transpose(0, 1).contiguous().transpose(0, 1)
    nc = {n: (relaid(x) if n != "initial_state" else x.detach()).requires_grad_()
          for n, x in kw.items()}
    nc["q"] = kw["q"].detach().permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0).requires_grad_()
    assert not nc["q"].is_contiguous() and not nc["k"].is_contiguous()
    plan = check(**nc, softmax_scale=0.3)
    o, s = recurrent_native(plan, nc["q"], nc["k"], nc["v"], gk=nc["gk"],
                            initial_state=nc["initial_state"])
    ro, rs = recurrent(**{n: x.detach().numpy() for n, x in nc.items()}, softmax_scale=0.3)
    assert rel(o, ro) < 1e-12 and rel(s, rs) < 1e-12


# --- precision --------------------------------------------------------------------------------

def scan32(q, k, v, gk):
    """A float32 step-by-step scan: the precision yardstick."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1])
    o = torch.empty(B, T, H, v.shape[-1])
    for t in range(T):
        S = gk[:, t].exp()[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K ** -0.5
    return o, S


@pytest.mark.parametrize("gate", [(-1.0, 0.0), (-5.0, -0.5), (-50.0, -5.0), "logsigmoid"])
def test_float32_at_scan_precision(gate):
    gen = torch.Generator().manual_seed(14)
    B, T, H, K, V = 1, 300, 2, 32, 32
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    if gate == "logsigmoid":
        gk = F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    else:
        gk = torch.rand(B, T, H, K, generator=gen) * (gate[1] - gate[0]) + gate[0]
    kw = dict(q=q, k=k, v=v, gk=gk)
    o, s = native_call(kw)
    ro, rs = oracle_call(kw)
    so, ss = scan32(q, k, v, gk)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    # a step-by-step fp32 scan reaches ~1e-7 here; long-chunk cumulative sums lose ~10x
    assert rel(o, ro) < max(3 * rel(so, ro), 5e-7), (rel(o, ro), rel(so, ro))
    assert rel(s, rs) < max(3 * rel(ss, rs), 5e-7), (rel(s, rs), rel(ss, rs))


@pytest.mark.parametrize("reverse", [False, True])
def test_float32_all_features(reverse):
    kw, cu = make(seed=15, seqlens=(100, 7, 0, 64), H=4, Hk=2, g="head", gk=True, gv=True,
                  g_gamma="seq", initial_state=True, dtype=torch.float32)
    check_all(kw, cu, reverse, tol=1e-5)


@pytest.mark.parametrize("gate", [(-50.0, -5.0), (-200.0, -20.0)])
def test_strong_gates_stay_finite(gate):
    """Per-step log gates of -5..-200 on every side: no inf/NaN, forward or backward, and
    gate gradients (true values down to ~1e-100) still match: no cancellation noise."""
    kw, cu = make(seed=16, seqlens=(70, 33), g="key", gk=True, gv=True, g_gamma="head",
                  initial_state=True, gate=gate, dtype=torch.float32)
    check_all(kw, cu, tol=1e-5)


def test_mixed_strong_and_weak_gates():
    """Some key dims decay at -50 a step, others barely: both regimes in one chunk."""
    kw, _ = make(seed=17, B=1, T=150, K=8, gk=True, gv=True, dtype=torch.float32)
    with torch.no_grad():
        kw["gk"][..., :4] *= 50.0
        kw["gk"][..., 4:] *= 0.01
        kw["gv"][:, ::7] = -40.0
    check_all(kw, tol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_low_precision(dtype, tol):
    """Low-precision inputs accumulate in fp32: errors at the level of the output rounding
    (compared with the oracle on the same rounded inputs)."""
    kw, cu = make(seed=18, seqlens=(60, 0, 45), H=4, Hk=2, g="head", gk=True, gv=True,
                  g_gamma="head", initial_state=True, dtype=dtype)
    check_all(kw, cu, reverse=True, tol=tol)


# --- autograd.gradcheck -----------------------------------------------------------------------

@pytest.mark.parametrize("case", ["batched", "varlen-reverse"])
def test_gradcheck(case):
    narrow = NativeConfig(log_decay_limit=0.5)  # narrow blocks: levels inside small chunks
    if case == "batched":
        kw, cu = make(seed=19, B=2, T=11, H=2, Hk=1, K=3, V=2, g="head", gk=True, gv=True,
                      g_gamma="head", initial_state=True)
        reverse = False
    else:
        kw, cu = make(seed=20, seqlens=(6, 0, 9), H=2, K=2, V=3, g="key", gv=True, g_gamma="seq",
                      initial_state=True)
        reverse = True
    names = [n for n in cases.INPUTS if n in kw]
    plan = check(**kw, reverse=reverse, cu_seqlens=cu)

    def fn(*xs):
        d = dict(zip(names, xs))
        return recurrent_native(plan, d["q"], d["k"], d["v"], g=d.get("g"), gk=d.get("gk"),
                                gv=d.get("gv"), g_gamma=d.get("g_gamma"),
                                initial_state=d.get("initial_state"), cu_seqlens=cu, chunk_size=8,
                                config=narrow)

    assert torch.autograd.gradcheck(fn, [kw[n] for n in names], eps=1e-6, atol=1e-7, rtol=1e-5)


# --- memory -----------------------------------------------------------------------------------

def test_saved_memory_is_the_inputs():
    """What autograd keeps for backward: the inputs, nothing else (the backward recomputes
    the rest slab by slab), so never per-step states (T * K * V would be 16x more here)."""
    B, T, H, K, V = 1, 2048, 2, 32, 32
    kw, _ = make(seed=21, B=B, T=T, H=H, K=K, V=V, gk=True, gv=True, initial_state=True,
                 dtype=torch.float32)
    seen = {}

    def pack(x):
        seen[(x.data_ptr(), x.untyped_storage().nbytes())] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        o, s = native_call(kw)
    saved = sum(seen.values())
    assert saved <= sum(x.untyped_storage().nbytes() for x in kw.values()), saved
    assert saved < B * T * H * K * V * 4  # far below per-step states
    (o.sum() + s.sum()).backward()


# --- the forward without autograd (slabs of chunk steps) ---------------------------------------

@pytest.mark.parametrize("case", ["batched", "varlen-reverse"])
def test_streamed_forward_matches_oracle(case):
    """Without autograd the forward runs a few chunk steps at a time (_streamed_forward);
    slabs shrunk so every slab holds one or two steps, sequences end inside and between
    slabs."""
    tiny = NativeConfig(slab_elements=2 * 2 * 8 * 8)  # one or two slots of [H, C=8, D]
    if case == "batched":
        kw, cu = make(seed=30, B=3, T=29, H=2, Hk=1, K=5, V=4, g="head", gk=True, gv=True,
                      g_gamma="head", initial_state=True)
        reverse = False
    else:
        kw, cu = make(seed=31, seqlens=(17, 0, 5, 30), H=2, K=4, V=3, g="key", gv=True,
                      g_gamma="seq", initial_state=True)
        reverse = True
    with torch.no_grad():
        o, s = native_call(kw, cu, reverse, chunk_size=8, config=tiny)
    wo, ws = oracle_call(kw, cu, reverse)
    assert not o.requires_grad
    assert rel(o, wo) < 1e-12 and rel(s, ws) < 1e-12


def tiny_slabs(kw, C, slots=1):
    """A config whose slabs, forward and backward, hold `slots` slots of [H, C, max(K, V)]
    (at least one chunk step): many slab boundaries."""
    H, K, V = kw["q"].shape[2], kw["q"].shape[3], kw["v"].shape[3]
    return NativeConfig(slab_elements=slots * H * C * max(K, V), slab_output_share=1,
                        backward_slab_scale=1)


SLABBED = {
    # sequences ending inside and between slabs, an empty one, GQA, every gate kind, h0
    "varlen-gqa-reverse": (dict(seqlens=(17, 0, 5, 30, 9), H=4, Hk=2, K=5, V=4, g="head",
                                gk=True, gv=True, g_gamma="seq", initial_state=True), True, 1e-10),
    "batched-key-gates": (dict(B=3, T=29, H=2, K=4, V=3, g="key", gv=True, g_gamma="head",
                               initial_state=True), False, 1e-10),
    "strong-gates-float32": (dict(seqlens=(40, 23), H=2, K=6, V=5, g="key", gk=True, gv=True,
                                  g_gamma="head", initial_state=True, gate=(-50.0, -5.0),
                                  dtype=torch.float32), False, 1e-5),
}


@pytest.mark.parametrize("case", list(SLABBED))
def test_slabbed_backward_matches_oracle(case):
    """The backward walks slabs of one chunk step (or two slots) in reverse, each recomputed
    from its entering state and handing the state gradient on: outputs and every gradient
    match the oracle with many slab boundaries, varlen sequences straddling them."""
    extra, reverse, tol = SLABBED[case]
    kw, cu = make(seed=34 + list(SLABBED).index(case), **extra)
    tiny = tiny_slabs(kw, 8, slots=2)
    check_all(kw, cu, reverse, tol=tol, chunk_size=8, config=tiny)
    if kw["q"].dtype != torch.float64:
        return
    # and against central finite differences along one random direction of every input
    gen = torch.Generator().manual_seed(42)
    step = {n: torch.randn(x.shape, generator=gen, dtype=x.dtype) for n, x in kw.items()}
    loss = lambda x: sum(y.sum() for y in native_call(x, cu, reverse, chunk_size=8, config=tiny))
    grads = torch.autograd.grad(loss(kw), list(kw.values()))
    with torch.no_grad():
        at = lambda e: loss({n: x + e * step[n] for n, x in kw.items()})
        fd = (at(1e-6) - at(-1e-6)) / 2e-6
    exact = sum((gr * step[n]).sum() for n, gr in zip(kw, grads))
    assert abs(float(fd - exact)) < 1e-6 * max(1.0, abs(float(exact))), (float(fd), float(exact))


def test_custom_op_backward_matches_oracle():
    """torch_side.recurrent(platform="torch"): the gla_bridge::bwd op's backward
    (recurrent_native_backward), and recurrent_native_backward itself in tiny slabs, with
    gradients from o alone, the final state alone, both."""
    import torch_side
    from torch_side.native import recurrent_native_backward

    kw, cu = make(seed=40, seqlens=(90, 0, 40, 130), H=2, K=4, V=3, g="head", gk=True,
                  gv=True, g_gamma="seq", initial_state=True)
    tiny = tiny_slabs(kw, 64)
    names = [n for n in cases.INPUTS if n in kw]
    gen = torch.Generator().manual_seed(41)
    for use in ("o", "state", "both"):
        reverse = use == "both"
        o, s = torch_side.recurrent(**kw, cu_seqlens=cu, reverse=reverse, platform="torch")
        do = torch.randn(o.shape, generator=gen, dtype=torch.float64) * (use != "state")
        ds = torch.randn(s.shape, generator=gen, dtype=torch.float64) * (use != "o")
        _, _, want = oracle_call(kw, cu, reverse, do.numpy(), ds.numpy())
        loss = (o * do).sum() if use == "o" else (s * ds).sum() if use == "state" else \
            (o * do).sum() + (s * ds).sum()
        grads = torch.autograd.grad(loss, [kw[n] for n in names])
        for n, gr in zip(names, grads):
            assert rel(gr, want[n]) < 1e-10, (use, n, rel(gr, want[n]))
        plan = check(**kw, reverse=reverse, cu_seqlens=cu)
        arrays = {n: kw[n].detach() if n in kw else None for n in cases.INPUTS}
        got = recurrent_native_backward(plan, arrays, cu, None if use == "state" else do,
                                        None if use == "o" else ds, config=tiny)
        assert sorted(got) == sorted(names)
        for n in names:
            assert rel(got[n], want[n]) < 1e-10, ("tiny slabs", use, n, rel(got[n], want[n]))


def test_streamed_memory_is_output_plus_a_slab():
    """With or without autograd the forward holds the output, the final state and one
    slab's workspace; the backward the gradients, the slab-entering states and one slab's
    workspace (the whole-sequence backward held ~20 arrays of an input's size). Tensor
    bytes alive at once, from the profiler's allocation events (the resident set's growth
    moved by megabytes with glibc's arenas under load)."""
    slabs = NativeConfig(slab_elements=1 << 14)  # 4 slots of [H=2, C=64, D=32]: 256 tokens
    B, T, H, K, V = 1, 16384, 2, 32, 32
    kw, _ = make(seed=32, B=B, T=T, H=H, K=K, V=V, g="key", dtype=torch.float32)
    plan = check(**kw)
    call = lambda x: recurrent_native(plan, x["q"], x["k"], x["v"], g=x["g"], config=slabs)
    with torch.no_grad():
        o, s = call(kw)
        peak = peak_tensor_bytes(lambda: call(kw))
    graph_peak = peak_tensor_bytes(lambda: call(kw))
    out = (o.numel() + s.numel()) * 4
    one_input = B * T * H * K * 4
    assert peak <= out + one_input, (peak, out)  # a slab: 1/64 of the tokens, ~25 arrays
    assert graph_peak <= out + one_input, (graph_peak, out)
    o, s = call(kw)
    do, ds = torch.ones_like(o), torch.ones_like(s)
    leaves = list(kw.values())
    back = lambda: torch.autograd.grad([o, s], leaves, [do, ds], retain_graph=True)
    back_peak = peak_tensor_bytes(back)
    assert back_peak <= 4 * one_input + 2 * one_input, (back_peak, one_input)  # 4 gradients


@pytest.mark.parametrize("T,reverse,case", [
    (1, False, dict(Hk=2, g="key", gk=True, gv=True, g_gamma="seq", initial_state=True)),
    (3, True, dict(Hk=2, g="key", gk=True, gv=True, g_gamma="seq", initial_state=True)),
    (1, False, dict(g="head", g_gamma="head")),  # no initial state, H == Hk
    (2, False, dict(Hk=2, gv=True, dtype=torch.bfloat16)),  # o in bf16, computed in fp32
    (2, False, dict(Hk=1, g="key")),  # one kv head, no initial state: the first state is
    # k^T v expanded over the query heads, then updated in place (needs its own memory)
])
def test_decode_steps_match_oracle(T, reverse, case):
    """A few tokens a row without autograd (decoding) take the step-by-step update (_stepwise):
    every gate kind, GQA, per-sequence g_gamma, with and without an initial state, a
    bfloat16 q; the inputs stay untouched."""
    case = dict(dict(dtype=torch.float32), **case)
    kw, _ = make(seed=33, B=2, T=T, H=4, K=5, V=3, **case)
    before = {n: x.detach().clone() for n, x in kw.items()}
    with torch.no_grad():
        o, s = native_call(kw, reverse=reverse)
    wo, ws = oracle_call(kw, reverse=reverse)
    assert o.dtype == case["dtype"] and s.dtype == torch.float32 and o.is_contiguous()
    tol = 1e-2 if case["dtype"] == torch.bfloat16 else 1e-6  # o rounded to bf16
    assert rel(o, wo) < tol and rel(s, ws) < 1e-6
    assert all(torch.equal(kw[n].detach(), before[n]) for n in kw)
