"""mode="fused_chunk" (one launch, the state on chip through the chunk loop) against the
float64 oracle: o and the final state on every gate kind, reverse, initial state,
varlen (empty and one-token sequences), GQA, the three dtypes, strong gates and
sequences of several chunks; its backward against the oracle's gradients through the
family's own plan: the on-chip walks (fused_chunk_bwd.py) on every variant they take, the
chunk family's launch list on the others (gv, g_gamma). Run through bridge.torch_runner
directly, in Triton's interpreter on this CPU machine.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import bridge.kernels  # noqa: E402,F401  (decides the interpreter before triton is imported)
import triton.language as tl  # noqa: E402
from bridge import contract, grads, torch_runner, tuning  # noqa: E402
from bridge.kernels import family, fused_chunk, fused_chunk_bwd  # noqa: E402
from bridge.kernels.common import next_pow2, op_dtype, wide_dtype  # noqa: E402
from bridge.launch import resolve_dtype  # noqa: E402
from parity import backends, cases  # noqa: E402
from parity.compare import assert_close, errors, rel_err, tolerance  # noqa: E402
# the chunk family's cases: every gate kind, reverse, varlen with empty and one-token
# sequences, GQA, odd K and V (FEATURES); sequences across several chunks (MULTI_CHUNK)
from test_triton_chunk import FEATURES, MULTI_CHUNK  # noqa: E402
# each split of a forward against the oracle and the unsplit launch
from test_fused_chunk_split import check as check_split  # noqa: E402

ORACLE = backends.Oracle()
FORWARD = ("o", "final_state")


@pytest.fixture(autouse=True)
def default_backward(monkeypatch):
    """The default backward choice (GLA_BRIDGE_FUSED_CHUNK_BWD unset) for every test here."""
    monkeypatch.delenv("GLA_BRIDGE_FUSED_CHUNK_BWD", raising=False)


def run_family(case, arrays, dtype, backward=False, use_dht=True, keep=True):
    """{o, final_state[, d<input>]} of fused_chunk's launch lists, float32 NumPy in each
    quantity's shape; keep=False: the forward keeps nothing and the backward builds A
    again."""
    plan, env, t = cases.launch_env(case, arrays, dtype)
    mod = family("fused_chunk")
    launches = mod.forward_launches(plan, keep=keep)
    kept = mod.kept(plan) if keep else ()
    # one launch; past K = 256 (64 in fp32), the K blocks' partial outputs and their sum
    split_k = fused_chunk.SPLIT_K if plan.dtype != "float32" else fused_chunk.SPLIT_K_FP32
    assert [{o.name for o in x.writes()} for x in launches] == (
        [{*FORWARD, *kept}] if plan.K <= split_k else [{"o_part", "final_state"}, {"o"}])
    torch_runner.run(launches, env)
    assert env["o"].dtype == t["q"].dtype and env["final_state"].dtype == torch.float32
    out = {"o": env["o"], "final_state": env["final_state"]}
    if backward:
        if not use_dht:
            env.pop("dfinal_state")
        bwd = mod.backward_launches(plan, use_dht, kept)
        assert any(x.constexprs.get("BTF") for x in bwd) == bool(kept)
        on_chip = fused_chunk_bwd.supported(plan)
        assert on_chip == any(x.kernel is fused_chunk_bwd.fused_chunk_bwd_dkv_kernel
                              for x in bwd), [x.kernel.__name__ for x in bwd]
        torch_runner.run(bwd, env)
        out.update({"d" + n: gr for n, gr in grads.assemble(plan, env).items()})
    return {n: x.float().numpy().reshape(arrays["do" if n == "o" else n[1:]].shape
                                         if n != "final_state" else x.shape)
            for n, x in out.items()}


def run_case(case, dtype="float32", seed=0, backward=False, use_dht=True, keep=True):
    """{quantity: relative error} against the oracle on the same rounded inputs."""
    arrays = backends.prepared(case, dtype, seed)
    if not use_dht:
        arrays["dfinal_state"] = np.zeros_like(arrays["dfinal_state"])
    got = run_family(case, arrays, dtype, backward, use_dht, keep)
    want = ORACLE.run(case, arrays, dtype)
    if not backward:
        want = {n: want[n] for n in FORWARD}
    assert set(got) == set(want), (sorted(got), sorted(want))
    return errors(got, want, case.gate_grad_floor)


C = cases.Case


@pytest.mark.parametrize("case", FEATURES, ids=lambda c: c.name)
def test_features_fp32(case):
    assert_close(run_case(case), "float32")


# MULTI_CHUNK: several chunks (the state carried on chip across them), small K and V
@pytest.mark.parametrize("case", MULTI_CHUNK, ids=lambda c: c.name)
def test_forward_several_chunks_fp32(case):
    assert_close(run_case(case), "float32")


def test_long_sequence_many_chunks():
    """520 tokens: 9 chunks, the last one 8 tokens long, the state carried through all."""
    case = C("long", T=520, H=1, Hk=1, K=8, V=8, g="key", gv=True, initial_state=True)
    assert_close(run_case(case), "float32")


@pytest.mark.parametrize("T", [36, 150])
def test_strong_gates_scan_precision(T):
    """Log gates of -0.2..-10 a step: the exponents are sums of consecutive log gates
    (<= 0), so o stays at fp32 scan level, as the chunk family's (same bound)."""
    case = C("strong", T=T, H=1, Hk=1, K=16, V=16, g="key", gv=True, initial_state=True,
             gate_scale=10.0)
    errs = run_case(case)
    assert all(np.isfinite(v) for v in errs.values()), errs
    assert errs["o"] < 2e-6 and errs["final_state"] < 2e-6, errs


def test_very_strong_gates_stay_finite():
    case = C("very-strong", T=70, H=1, Hk=1, g="key", gk=True, gv=True, g_gamma="head",
             initial_state=True, gate_scale=1e4)
    errs = run_case(case)
    assert all(np.isfinite(v) for v in errs.values()), errs
    assert_close(errs, "float32")


@pytest.mark.parametrize("T", [20, 150])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision(dtype, T):
    """16-bit operands to tl.dot, fp32 accumulation: within the dtype's tolerance of the
    oracle on the same rounded inputs."""
    case = C("low", T=T, H=2, Hk=1, K=16, V=24, g="key", gv=True, initial_state=True)
    assert_close(run_case(case, dtype), dtype)


# decays the same for every key beside gv: in 16 bits A from the pairs' decay sums (intra's
# PAIRS), gv's value levels on it, both key gates' factors on the rows of q S and of v;
# fp32 by the levels
SCALAR_GV = [
    C("head-gv-h0", T=150, H=2, Hk=1, K=40, V=24, g="head", gv=True, initial_state=True),
    C("gamma-gv-rev", T=150, H=2, Hk=2, K=16, V=40, g_gamma="head", gv=True, reverse=True),
    C("head-gamma-gv-varlen", H=2, Hk=1, K=8, V=8, seqlens=(70, 0, 1, 33), g="head",
      g_gamma="seq", gv=True, initial_state=True, packed=True),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", SCALAR_GV, ids=lambda c: c.name)
def test_scalar_decays_beside_gv(case, dtype):
    assert_close(run_case(case, dtype), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scalar_decays_beside_gv_strong(dtype):
    """Head log gates of -0.2..-10 a step beside gv's: fp32 (A by the levels there) at fp32
    scan level (the bound of test_strong_gates_scan_precision), bf16 (A from the pairs'
    sums) finite and within its tolerance."""
    errs = run_case(C("strong-head-gv", T=150, H=1, Hk=1, K=16, V=16, g="head", gv=True,
                      initial_state=True, gate_scale=10.0), dtype)
    assert all(np.isfinite(v) for v in errs.values()), errs
    if dtype == "float32":
        assert errs["o"] < 2e-6 and errs["final_state"] < 2e-6, errs
    assert_close(errs, dtype)


def test_two_value_blocks_and_wide_k():
    """K = 100, V = 80 in fp32: K split past 64 (FMA products keep whole K rows per
    thread), in 4 blocks of 32 with gv (the last one masked), three V blocks of 32; 64
    keys in one block; 16-token chunks with gv and per-key decays (the CPU's plan, as
    sm_80's)."""
    case = C("blocks", T=72, H=1, Hk=1, K=100, V=80, g="head", gv=True, initial_state=True)

    def plan(K, gv, gk=False):
        def z(d):
            return np.zeros((1, 1, 1, d), np.float32)
        return contract.check(z(K), z(K), z(80), gv=z(80) if gv else None,
                              gk=z(K) if gk else None)

    assert fused_chunk.config(plan(100, True)) == dict(BK=32, BKI=16, BV=32, NV=3,
                                                       num_warps=8, stages=1, BT=32)
    assert fused_chunk.config(plan(100, False))["BK"] == 64
    assert fused_chunk.config(plan(64, False)) == dict(BK=64, BKI=16, BV=32, NV=3,
                                                       num_warps=8, stages=1, BT=32)
    assert fused_chunk.config(plan(64, True, gk=True))["BT"] == 16
    assert_close(run_case(case), "float32")


def test_bf16_key_decays_past_64_keys_on_16_token_chunks():
    """Without wgmma (sm_80's plan, the CPU's) bf16 with per-key decays over more than 64
    keys takes 16-token chunks (its lean 32-token tiles spilled on sm_80), 64 keys and a
    head gate 32: against the oracle, forward and every gradient, across several chunks."""
    bf16 = [torch.zeros(1, 1, h, d, dtype=torch.bfloat16) for h, d in ((2, 96), (1, 96),
                                                                       (1, 40))]

    def bt(K, g):
        qk = [x[..., :K] for x in bf16[:2]]
        return fused_chunk.config(contract.check(*qk, bf16[2], g=g[..., :K] if g.ndim == 4
                                                 else g))["BT"]

    key, head = torch.zeros(1, 1, 2, 96, dtype=torch.bfloat16), torch.zeros(1, 1, 2)
    assert (bt(96, key), bt(64, key), bt(96, head)) == (16, 32, 32)
    case = C("bf16-key-96", T=70, H=2, Hk=1, K=96, V=40, g="key", initial_state=True)
    assert_close(run_case(case, "bfloat16", backward=True), "bfloat16")


@pytest.mark.parametrize("name, dtype, K, device, want", [
    # without wgmma (sm_80's plan, the CPU's): gv's levels from 64-key blocks (K = 100
    # padded to 128 and masked in fp16), 4 warps at K <= 32 without gates, 8 for the lean
    # tiles with per-key decays at K = 64
    ("gv-bf16-64", "bfloat16", 64, None, dict(BKI=64, num_warps=8, BT=32)),
    ("gv-fp16-100", "float16", 100, None, dict(BKI=64, num_warps=8, BT=32)),
    ("fp16-32", "float16", 32, None, dict(num_warps=4, BT=32, stages=3)),
    # without decays the chunk loop pipelined (fp16 past 64 keys at 2 stages, bf16 at 8
    # warps), but at K = 16
    ("bare-bf16-96", "bfloat16", 96, None, dict(BKI=64, num_warps=8, stages=3, BT=32)),
    ("bare-fp16-96", "float16", 96, None, dict(BKI=64, num_warps=4, stages=2, BT=32)),
    ("bare-bf16-16", "bfloat16", 16, None, dict(num_warps=4, stages=1, BT=32)),
    ("lean-bf16-64", "bfloat16", 64, None, dict(BKI=64, num_warps=8, BT=32)),
    # fp16's lean tiles as bf16's: per-key decays past 64 keys at 4 warps on 16-token
    # chunks (8 warps on 32 spilled in the loop), a head gate at K <= 32 on 8 warps
    ("lean-fp16-96", "float16", 96, None, dict(BKI=64, num_warps=4, BT=16)),
    # decays the same for every key: A without levels, the key blocks all of K, the chunk
    # loop pipelined at 4 warps on 32-wide V blocks and 32-token chunks, on every arch
    ("head-bf16-32", "bfloat16", 32, None, dict(BKI=32, BV=32, num_warps=4, stages=3, BT=32)),
    # (a head gate with mma.sync past 64 keys on 64-key blocks)
    ("head-fp16-96", "float16", 96, None, dict(BKI=64, BV=32, num_warps=4, stages=3, BT=32)),
    ("gamma-bf16-128", "bfloat16", 128, None,
     dict(BKI=128, BV=32, num_warps=4, stages=3, BT=32)),
    # (with mma.sync on 32-key blocks at K = 64, and fp16's g_gamma past 64 keys: on all
    # of K it spilled in the loop at K = 100, keys masked in the last block)
    ("head-bf16-64", "bfloat16", 64, None, dict(BKI=32, BV=32, num_warps=4, stages=3, BT=32)),
    ("gamma-fp16-100", "float16", 100, None,
     dict(BKI=32, BV=32, num_warps=4, stages=3, BT=32)),
    # sm_90: gv's levels beside V blocks of 64 (wgmma), fp16 with per-key decays and gv
    # past 64 keys on 16-token chunks
    ("gv-bf16-64-sm90", "bfloat16", 64, "9.0 Fake GPU", dict(BKI=64, BV=64, BT=32)),
    ("gv-fp16-100-sm90", "float16", 100, "9.0 Fake GPU", dict(BKI=64, BV=64, BT=16)),
    ("head-fp16-64-sm90", "float16", 64, "9.0 Fake GPU",
     dict(BKI=64, BV=32, num_warps=4, stages=3, BT=32)),
    ("head-bf16-96-sm90", "bfloat16", 96, "9.0 Fake GPU",  # (bf16's past 64 keys on 32)
     dict(BKI=32, BV=32, num_warps=4, stages=3, BT=32)),
    ("gamma-fp16-96-sm90", "float16", 96, "9.0 Fake GPU",
     dict(BKI=128, BV=32, num_warps=4, stages=3, BT=32)),
    # sm_90: all of V (40, padded to 64) in one block, pipelined, at K = 64 in both 16-bit
    # dtypes, where 4 warps and 64-wide blocks were unpipelined
    ("whole-bf16-64-sm90", "bfloat16", 64, "9.0 Fake GPU",
     dict(BKI=64, BV=64, num_warps=8, stages=3, BT=32)),
    ("whole-fp16-64-sm90", "float16", 64, "9.0 Fake GPU",
     dict(BKI=64, BV=64, num_warps=8, stages=3, BT=32)),
])
def test_spill_free_16bit_tiles(name, dtype, K, device, want):
    """The 16-bit forward tiles `fused_chunk.config` takes where the others spilled on
    sm_80 or sm_90 (the builds: tests/test_compiled_build.py's 16-bit spill tests),
    through the interpreter against the oracle: every gate but the lean and whole cases'
    key gate alone and the head cases' head gate, across several chunks (the gv plans'
    backward is the chunk family's list, the others' the on-chip walks)."""
    gv = name.startswith("gv")
    keyed = name.startswith(("lean", "whole"))
    gates = (dict(g="key", gk=True, gv=True, g_gamma="head") if gv else dict(g="key")
             if keyed else dict(g="head") if name.startswith("head")
             else dict(g_gamma="head") if name.startswith("gamma") else {})
    case = C(name, T=70, H=2, Hk=1, K=K, V=40, initial_state=True, **gates)
    with tuning.on_device(device):
        plan = cases.launch_env(case, backends.prepared(case, dtype, 0), dtype)[0]
        got = fused_chunk.config(plan)
        assert {k: got[k] for k in want} == want, got
        assert_close(run_case(case, dtype, backward=not gv and bool(gates)), dtype)
        if device:  # sm_90's gv tiles split into 2 segments too (local pass, combine),
            # under weak gates, so that a segment's incoming state shows in o
            check_split(case.with_(gate_scale=0.02), dtype, splits=(2,))


def test_one_token_sequences_and_empty():
    """Sequences of 1 and 0 tokens: an empty one's final state is its initial state."""
    case = C("ones", H=2, Hk=1, K=4, V=4, seqlens=(1, 0, 1, 0), g="head", gv=True,
             g_gamma="head", initial_state=True, packed=True)
    arrays = backends.prepared(case, "float32", 0)
    got = run_family(case, arrays, "float32")
    want = ORACLE.run(case, arrays, "float32")
    assert_close(errors(got, {n: want[n] for n in FORWARD}), "float32")
    np.testing.assert_array_equal(got["final_state"][[1, 3]], arrays["initial_state"][[1, 3]])


@pytest.mark.parametrize("case", [
    # the chunk family's launch list (gv, g_gamma)
    C("bwd-everything", H=2, Hk=1, K=5, V=7, g="key", gk=True, gv=True, g_gamma="seq",
      initial_state=True, reverse=True, seqlens=(70, 1, 0, 18), packed=True),
    # the on-chip walks: 16-token chunks, so every case crosses several
    C("bwd-plain-gqa", T=40, H=4, Hk=2, K=8, V=8),
    C("bwd-head-gqa", T=80, H=4, Hk=2, K=8, V=8, g="head", initial_state=True),
    C("bwd-key-gk-rev", T=37, H=1, Hk=1, K=8, V=12, g="key", gk=True, initial_state=True,
      reverse=True),
    C("bwd-head-gk-varlen", H=2, Hk=1, K=5, V=7, g="head", gk=True, initial_state=True,
      reverse=True, seqlens=(70, 1, 0, 18), packed=True),
    C("bwd-gk-varlen-empty-first", H=1, Hk=1, K=8, V=8, gk=True, seqlens=(0, 33, 1),
      packed=True),
], ids=lambda c: c.name)
def test_backward_gradients(case):
    """Every gradient through the family's backward plan, against the oracle's."""
    assert_close(run_case(case, backward=True), "float32")


def _a_by_definition(q, k, a, scale, bt, starts):
    """A [T,H,bt] float64 from its definition (intra.py): scale sum_k q_tk k_sk e^(sum of
    a_rk over s < r <= t) for s <= t in the same bt-token chunk of its sequence, column s's
    place in that chunk; q, a [T,H,K], k [T,Hk,K] (one sequence after another from
    `starts`, the sequences' first rows and the total)."""
    T, H, K = q.shape
    k = np.repeat(k, H // k.shape[1], axis=1)
    out = np.zeros((T, H, bt))
    for bos, eos in zip(starts[:-1], starts[1:]):
        for t in range(bos, eos):
            c0 = bos + (t - bos) // bt * bt
            for s in range(c0, t + 1):
                decay = np.exp(a[s + 1:t + 1].sum(0))  # [H, K]
                out[t, :, s - c0] = scale * (q[t] * k[s] * decay).sum(-1)
    return out


KEPT_CASES = [C("kept", T=70, H=2, Hk=1, K=24, V=8, g="key", initial_state=True),
              C("kept-gk-varlen", H=2, Hk=2, K=16, V=8, gk=True, seqlens=(40, 0, 1, 29),
                packed=True)]


def _transposed_by_chunk(a, bt, starts):
    """A^T of `_a_by_definition`'s A [T,H,bt]: row s, column t's place in s's chunk (0
    past the sequence's end)."""
    out = np.zeros_like(a)
    for bos, eos in zip(starts[:-1], starts[1:]):
        for s in range(bos, eos):
            c0 = bos + (s - bos) // bt * bt
            for j in range(min(bt, eos - c0)):
                out[s, :, j] = a[c0 + j, :, s - c0]
    return out


@pytest.mark.parametrize("case", KEPT_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", ["8.0 Fake GPU", "9.0 Fake GPU"], ids=("sm80", "sm90"))
def test_kept_a_is_a_by_definition(case, dtype, device):
    """With per-key decays the forward keeps A [B,T,H,BT] for the dv walk (fused_chunk.kept:
    fp32, bf16 in bf16; on sm_90's tiles as A^T, fused_chunk_bwd.kept_transposed): the
    float64 definition on the same rounded inputs, chunk by chunk of each sequence,
    within the dtype's tolerance; without `keep` the forward writes o and the final
    state alone."""
    arrays = backends.prepared(case, dtype, 0)
    with tuning.on_device(device):
        plan, env, t = cases.launch_env(case, arrays, dtype)
        assert fused_chunk.kept(plan) == ("A",)
        launches = fused_chunk.forward_launches(plan)
        transposed = fused_chunk_bwd.kept_transposed()
        assert transposed == device.startswith("9")
        torch_runner.run(launches, env)
        plain = fused_chunk.forward_launches(plan, keep=False)
    bt = launches[-1].constexprs["BT"]
    got = env["A"].double().numpy().reshape(-1, case.H, bt)
    assert env["A"].dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    f64 = {n: np.asarray(arrays[n], np.float64).reshape(-1, *np.shape(arrays[n])[-2:])
           for n in ("q", "k", "g" if case.g == "key" else "gk")}
    starts = np.asarray(arrays["cu_seqlens"]) if case.seqlens else np.array([0, case.T])
    want = _a_by_definition(f64["q"], f64["k"], f64["g" if case.g == "key" else "gk"],
                            plan.scale, bt, starts)
    if transposed:
        want = _transposed_by_chunk(want, bt, starts)
    assert rel_err(got, want) <= tolerance(dtype), rel_err(got, want)
    assert [{o.name for o in x.writes()} for x in plain] == [set(FORWARD)]


@pytest.mark.parametrize("case", [
    C("again-key-reverse", T=70, H=2, Hk=1, K=24, V=8, g="key", initial_state=True,
      reverse=True),
    C("again-gk-varlen", H=2, Hk=2, K=16, V=8, gk=True, seqlens=(40, 0, 1, 29), packed=True)],
    ids=lambda c: c.name)
def test_backward_builds_a_again_without_kept(case):
    """The dv walk builds A itself where the forward kept none (keep=False): every
    gradient against the oracle's, as with the kept A (test_backward_gradients)."""
    assert_close(run_case(case, backward=True, keep=False), "float32")


def test_kept_rule():
    """A is kept with per-key decays where the on-chip backward runs and the dv walk's
    chunks tile the forward's: not for decays the same for every key or none (one
    product to build again), gv (the chunk list), or K split in the forward; the dv walk
    then on the forward's chunks (BTF), pipelined."""
    def plan(K, V, dtype="bfloat16", **gates):
        return contract.Plan(B=1, T=64, H=2, Hk=2, K=K, V=V, N=1, g=gates.get("g", "none"),
                             gk=gates.get("gk", False), gv=gates.get("gv", False),
                             g_gamma=gates.get("g_gamma", "none"), initial_state=False,
                             scale=0.1, reverse=False, varlen=False, packed=False, dtype=dtype)

    keeps = lambda *a, **g: fused_chunk.kept(plan(*a, **g)) == ("A",)
    assert keeps(128, 128, g="key") and keeps(64, 64, gk=True) and keeps(64, 64, "float32", g="key")
    assert not keeps(128, 128, g="head") and not keeps(128, 128)
    assert not keeps(64, 64, g_gamma="head") and not keeps(64, 64, g="key", gv=True)
    assert not keeps(128, 128, "float32", g="key")  # the chunk list (fused_chunk_bwd.supported)
    # the dv walk of the kept A (sm_80's tiles, the CPU's): on the forward's chunks (but
    # 16 with both g and gk, where 32 spilled) and pipelined past 64 keys too
    def dv(p):
        walk = [x for x in fused_chunk.backward_launches(p, True, fused_chunk.kept(p))
                if x.constexprs.get("DV")]
        return [(x.constexprs["BT"], x.constexprs["BTF"], x.constexprs["STAGES"]) for x in walk]

    assert dv(plan(128, 128, g="key")) == [(16, 16, 3)]
    assert dv(plan(64, 64, "float16", g="key")) == [(32, 32, 3)]
    assert dv(plan(64, 64, g="key", gk=True)) == [(16, 32, 3)]
    assert dv(plan(64, 64, "float32", g="key")) == [(16, 32, 1)]
    # A stored as A^T on sm_90's tiles (the forward that stores A spilled there), as A
    # on sm_80's (A^T spilled)
    a_t = lambda p: {x.constexprs["A_T"] for x in fused_chunk.forward_launches(p)  # noqa: E731
                     + fused_chunk.backward_launches(p, True, fused_chunk.kept(p))
                     if x.constexprs.get("KEEP_A") or x.constexprs.get("BTF")}
    assert a_t(plan(128, 128, g="key")) == {False}
    # the buffer's dtype (host, kept_a) is the one the kernels make A in (common.wide_dtype
    # of the dot operands' dtype), so the store rounds nothing away and wastes no bytes
    for dt in ("bfloat16", "float16", "float32"):
        p = plan(64, 64, dt, g="key")
        host = resolve_dtype(fused_chunk_bwd.kept_a(p, 32).dtype, p.tensor_dtype)
        assert getattr(tl, host) == wide_dtype(op_dtype(getattr(tl, dt))), dt
    with tuning.on_device("9.0 Fake GPU"):
        assert fused_chunk.kept(plan(128, 128, g="key")) == ("A",)
        assert dv(plan(128, 128, g="key")) == [(32, 32, 3)]
        assert dv(plan(128, 128, "float16", g="key")) == [(16, 16, 3)]
        assert a_t(plan(128, 128, g="key")) == {True}


def test_backward_choice(monkeypatch):
    """On chip by default; GLA_BRIDGE_FUSED_CHUNK_BWD=chunk takes the chunk family's list."""
    plan = contract.check(np.zeros((1, 4, 1, 8), np.float32), np.zeros((1, 4, 1, 8), np.float32),
                          np.zeros((1, 4, 1, 8), np.float32))
    assert fused_chunk_bwd.supported(plan)
    monkeypatch.setenv("GLA_BRIDGE_FUSED_CHUNK_BWD", "chunk")
    assert not fused_chunk_bwd.supported(plan)
    names = [x.kernel.__name__ for x in fused_chunk.backward_launches(plan, True)]
    assert names == [x.kernel.__name__ for x in family("chunk").backward_launches(plan, True)]


def test_backward_rule():
    """Which plans the on-chip walks take (fused_chunk_bwd.supported): those whose builds
    have no spills; no gv; g_gamma alone in 16 bits up to K = V = 128 (on sm_90, faked:
    tuning.wgmma, fp16 past 64 with its dq and dk walks at 8 warps; on sm_80's tiles, the
    CPU's, on 32-key blocks); the warps, K blocks and pipelining of the walks where
    others spilled."""
    def plan(K, V, dtype="bfloat16", **gates):
        return contract.Plan(B=1, T=64, H=2, Hk=2, K=K, V=V, N=1, g=gates.get("g", "none"),
                             gk=gates.get("gk", False), gv=gates.get("gv", False),
                             g_gamma=gates.get("g_gamma", "none"), initial_state=False,
                             scale=0.1, reverse=False, varlen=False, packed=False, dtype=dtype)

    assert fused_chunk_bwd.supported(plan(128, 128, g="key"))
    assert fused_chunk_bwd.supported(plan(128, 128, "float16", g="head"))
    assert not fused_chunk_bwd.supported(plan(128, 256))
    assert not fused_chunk_bwd.supported(plan(128, 128, g="key", gk=True))
    assert fused_chunk_bwd.supported(plan(64, 64, g="key", gk=True))
    assert not fused_chunk_bwd.supported(plan(128, 128, "float32"))
    assert fused_chunk_bwd.supported(plan(64, 64, "float32", gk=True))
    assert not fused_chunk_bwd.supported(plan(64, 64, gv=True))
    assert fused_chunk_bwd.supported(plan(64, 64, g_gamma="head"))
    assert not fused_chunk_bwd.supported(plan(64, 64, "float32", g_gamma="head"))
    # sm_80's tiles: the dq and dk walks on 32-key blocks with g_gamma, beside V under
    # 128 and with per-key decays over 64 keys at most; every walk pipelined in 16 bits
    # but the dk walk of fp16 with per-key decays past 96 keys or on V = 32, the dv walk
    # with per-key decays past 64 keys or with both g and gk, and the dq walk with both
    # on V = 32
    def sk_stages(K, V, dtype="bfloat16", **gates):
        c = fused_chunk_bwd.config(plan(K, V, dtype, **gates))
        return c["SK"], tuple(c["stages"][w] for w in ("bwd_dq", "bwd_dk", "bwd_dv"))

    assert sk_stages(128, 128, g="key") == (64, (3, 3, 1))
    assert sk_stages(128, 128, "float16", g="key") == (64, (3, 1, 1))
    assert sk_stages(64, 64, g="key") == (32, (3, 3, 3))
    assert sk_stages(32, 32, "float16", gk=True) == (32, (3, 1, 3))
    assert sk_stages(64, 32, g="key", gk=True) == (32, (1, 3, 1))
    assert sk_stages(64, 64, g="head", gk=True) == (32, (3, 3, 1))
    assert sk_stages(128, 128, g="head") == (64, (3, 3, 3))
    assert sk_stages(128, 128, g_gamma="head") == (32, (3, 3, 3))
    assert sk_stages(64, 64, "float32", g="key") == (16, (1, 1, 1))
    # off sm_90 the dk walk that folds a head gate's gradient (all of K in one block) at 8
    # warps (4 spilled at K = 50); beside V under 128 its K blocks of 32 at 4, no fold
    head = {(K, V, dt): fused_chunk_bwd.config(plan(K, V, dt, g="head"))["warps"]
            for K, V, dt in ((32, 32, "bfloat16"), (64, 128, "float16"), (64, 64, "float16"),
                             (128, 128, "bfloat16"), (64, 64, "float32"))}
    assert {k: (w["bwd_dq"], w["bwd_dk"]) for k, w in head.items()} == {
        (32, 32, "bfloat16"): (4, 8), (64, 128, "float16"): (4, 8),
        (64, 64, "float16"): (4, 4), (128, 128, "bfloat16"): (4, 4),
        (64, 64, "float32"): (8, 8)}
    assert fused_chunk_bwd.config(plan(64, 64, g="key"))["warps"]["bwd_dk"] == 4
    with tuning.on_device("9.0 Fake GPU"):
        assert fused_chunk_bwd.config(plan(64, 64, g="head"))["warps"]["bwd_dk"] == 4
        assert fused_chunk_bwd.supported(plan(128, 128, g_gamma="head"))
        assert fused_chunk_bwd.supported(plan(64, 64, "float16", g_gamma="seq"))
        assert fused_chunk_bwd.supported(plan(128, 128, "float16", g_gamma="head"))
        assert not fused_chunk_bwd.supported(plan(128, 256, "float16", g_gamma="head"))
        assert sk_stages(64, 64, g="key") == (64, (3, 3, 3))
        assert sk_stages(128, 128, g_gamma="head") == (64, (3, 3, 3))
        # fp16's dq and dk walks with g_gamma past 64 keys or values at 8 warps (4 spilled)
        warps = {(K, V): fused_chunk_bwd.config(plan(K, V, "float16", g_gamma="head"))["warps"]
                 for K, V in ((64, 64), (64, 128), (128, 64), (96, 96))}
        assert {kv: (w["bwd_dq"], w["bwd_dk"]) for kv, w in warps.items()} == {
            (64, 64): (4, 4), (64, 128): (8, 8), (128, 64): (8, 8), (96, 96): (8, 8)}
        assert fused_chunk_bwd.config(plan(128, 128, g_gamma="head"))["warps"]["bwd_dq"] == 4
        assert not fused_chunk_bwd.supported(plan(64, 64, g="head", g_gamma="head"))
        assert not fused_chunk_bwd.supported(plan(32, 32, "float32", g_gamma="head"))


# g_gamma's on-chip walks (sm_90's tiles, faked, and sm_80's, the CPU's): its gradient a
# sum over every step, both forms, the fold (all of K in one block: K <= 64 on sm_90, 32
# on sm_80) and the combine (K = 96: K blocks of 64 or 32), varlen with an empty and a
# one-token sequence, reversed, with an initial state and without
WALKS = {"fused_chunk_bwd_dq_kernel", "fused_chunk_bwd_dkv_kernel",
         "fused_chunk_bwd_combine_kernel"}
GAMMA_CASES = [C("gamma-fold", T=70, H=2, Hk=1, K=64, V=40, g_gamma="head", initial_state=True),
               C("gamma-fold-32", T=70, H=2, Hk=1, K=32, V=24, g_gamma="head"),
               C("gamma-combine-seq", T=70, H=2, Hk=2, K=96, V=100, g_gamma="seq",
                 initial_state=True),
               C("gamma-varlen-rev", H=2, Hk=1, K=96, V=64, seqlens=(40, 0, 1, 37),
                 g_gamma="head", reverse=True, packed=True)]


@pytest.mark.parametrize("case", GAMMA_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("device", ["9.0 Fake GPU", "8.0 Fake GPU"], ids=("sm90", "sm80"))
def test_gamma_walks(case, dtype, device):
    """g_gamma through the walks (no chunk-family launch in the backward), forward and
    every gradient within the dtype's tolerance of the float64 oracle; on sm_90 fp16 past
    K = 64 (or V) with the dq and dk walks at 8 warps, on sm_80 those on 32-key blocks
    at 4, the gradient folded into the dk walk where one block holds all of K."""
    with tuning.on_device(device):
        plan = cases.launch_env(case, backends.prepared(case, dtype, 0), dtype)[0]
        launches = fused_chunk.backward_launches(plan, True)
        assert {x.kernel.__name__ for x in launches} <= WALKS, launches
        wide16 = dtype == "float16" and max(case.K, case.V) > 64 and device.startswith("9")
        assert launches[0].num_warps == (8 if wide16 else 4)
        block = 64 if device.startswith("9") else 32
        assert launches[0].constexprs["BK"] == min(block, max(16, next_pow2(case.K)))
        folded = launches[-1].kernel.__name__ != "fused_chunk_bwd_combine_kernel"
        assert folded == (case.K <= block)
        assert_close(run_case(case, dtype, backward=True), dtype)


@pytest.mark.parametrize("g, varlen", [("key", False), ("head", False), ("head", True)])
def test_backward_several_blocks(g, varlen):
    """K = 40, V = 40 in fp32: the dq and dk walks take three K blocks of 16, the dv walk
    three V blocks. The dk walk finishes dq, dk and the key gate's gradient itself (fold);
    a head gate's gradient sums over the K blocks, so there the combine pass does (on its
    32-token chunks: across two, and reversed over varlen sequences of 70, 0, 1 and 33)."""
    case = C("bwd-blocks", T=40, H=1, Hk=1, K=40, V=40, g=g, initial_state=True)
    if varlen:
        case = case.with_(seqlens=(70, 0, 1, 33), packed=True, reverse=True)
    plan, _, _ = cases.launch_env(case, backends.prepared(case, "float32", 0), "float32")
    names = [ln.kernel.__name__ for ln in fused_chunk_bwd.launches(plan, True)]
    assert names[-1] == ("fused_chunk_bwd_combine_kernel" if g == "head" else
                         "fused_chunk_bwd_dkv_kernel"), names
    assert_close(run_case(case, backward=True), "float32")


def test_backward_without_final_state_cotangent():
    case = C("bwd-no-dht", T=40, H=2, Hk=1, K=8, V=8, g="key", initial_state=True)
    assert_close(run_case(case, backward=True, use_dht=False), "float32")


@pytest.mark.parametrize("gate_scale", [10.0, 1e4])
def test_backward_strong_gates(gate_scale):
    """Log gates of -0.2..-10 (and -2e3..-1e4: every chunk's decay underflows) a step over
    7 chunks: exponents are sums of consecutive decays, the gate gradients stay within the
    fp32 tolerance and finite."""
    case = C("bwd-strong", T=100, H=1, Hk=1, K=16, V=16, g="key", gk=True,
             initial_state=True, gate_scale=gate_scale)
    errs = run_case(case, backward=True)
    assert all(np.isfinite(v) for v in errs.values()), errs
    assert_close(errs, "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_low_precision(dtype):
    """16-bit operands, fp32 accumulation: every gradient within the dtype's tolerance."""
    case = C("bwd-low", T=50, H=2, Hk=1, K=16, V=24, g="key", initial_state=True)
    assert_close(run_case(case, dtype, backward=True), dtype)


SM90_CASES = [C("sm90", T=70, H=2, Hk=1, K=96, V=100, g="key", initial_state=True),
              C("sm90-reverse", T=70, H=2, Hk=1, K=96, V=100, g="key", initial_state=True,
                reverse=True),
              C("sm90-varlen-head", H=2, Hk=2, K=64, V=100, seqlens=(40, 0, 1, 29),
                g="head", initial_state=True, packed=True),
              C("sm90-varlen-key", H=2, Hk=1, K=96, V=100, seqlens=(40, 0, 1, 29),
                g="key", initial_state=True, packed=True),
              C("sm90-none", T=70, H=2, Hk=1, K=96, V=100, g="none", initial_state=True)]


@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: c.name)
def test_sm90_tiles_bf16(case):
    """On a device of capability 9.x (faked; no SM count, so no split) the bf16 forward
    with per-key decays takes all of V in one block (BV 128, 8 warps, key blocks of 128,
    its chunk loop pipelined: key blocks and levels unrolled), the dv walk all of V (SV
    128, 8 warps) on 32-token chunks (in fp16 with key decays past 64 keys 16), every
    walk pipelined (level loops unrolled), where the CPU's plan takes V blocks of 64 and
    32, 16-token chunks, runtime loops in the forward and the dv walk: forward and every
    gradient within bf16's tolerance of the oracle, across several chunks, with K = 96
    and V = 100 padded (masked key and value columns), reversed, and varlen with an empty and
    a one-token sequence under a head gate."""
    bf16 = [torch.zeros(1, 1, h, d, dtype=torch.bfloat16) for h, d in ((2, 96), (1, 96),
                                                                       (1, 100))]
    plan = contract.check(*bf16, g=torch.zeros(1, 1, 2, 96, dtype=torch.bfloat16))
    narrow = (fused_chunk.config(plan), fused_chunk_bwd.config(plan))
    with tuning.on_device("9.0 Fake GPU"):
        wide = (fused_chunk.config(plan), fused_chunk_bwd.config(plan))
        errs = run_case(case, "bfloat16", backward=True)
    assert (narrow[0]["BV"], narrow[0]["num_warps"], narrow[1]["SV"]) == (64, 4, 32)
    assert wide[0] == dict(BK=128, BKI=128, BV=128, NV=1, num_warps=8, stages=3, BT=32)
    assert narrow[0]["stages"] == 1
    assert wide[1]["SV"] == 128 and wide[1]["warps"]["bwd_dv"] == 8
    # the dv walk on 32-token chunks with K = 96 masked in its block of 128 beside V > K
    assert wide[1]["chunks"] == dict(bwd_dq=16, bwd_dk=16, bwd_dv=32)
    assert narrow[1]["chunks"] == dict(bwd_dq=16, bwd_dk=16, bwd_dv=16)
    # the walks pipelined (level loops unrolled) on sm_90 in bf16, every gate (fp16's
    # below); on sm_80's tiles the dv walk with per-key decays past 64 keys not
    assert (wide[1]["stages"], narrow[1]["stages"]) == (dict(bwd_dq=3, bwd_dk=3, bwd_dv=3),
                                                      dict(bwd_dq=3, bwd_dk=3, bwd_dv=1))
    # fp16: every walk pipelined but the dk walk with per-key decays past 96 keys; its dv
    # walk on 16-token chunks with key decays past 64 keys (on 32 it spilled)
    with tuning.on_device("9.0 Fake GPU"):
        c16 = fused_chunk_bwd.config(cases.launch_env(case, backends.prepared(
            case, "float16", 0), "float16")[0])
        assert c16["stages"] == dict(bwd_dq=3, bwd_dk=3, bwd_dv=3)
        assert c16["chunks"]["bwd_dv"] == (16 if case.g != "none" and case.K > 64 else 32)
        fp16 = [torch.zeros(1, 1, 2, 128, dtype=torch.float16) for _ in range(3)]
        wide_k = contract.check(*fp16, g=torch.zeros(1, 1, 2, 128, dtype=torch.float16))
        assert fused_chunk_bwd.config(wide_k)["stages"] == dict(bwd_dq=3, bwd_dk=1, bwd_dv=3)
        narrow_k = contract.check(*[x[..., :64] for x in fp16],
                                  g=torch.zeros(1, 1, 2, 64, dtype=torch.float16))
        assert fused_chunk_bwd.config(narrow_k)["chunks"]["bwd_dv"] == 32
        head = contract.check(*bf16, g=torch.zeros(1, 1, 2, dtype=torch.bfloat16))
        assert fused_chunk_bwd.config(head)["stages"] == dict(bwd_dq=3, bwd_dk=3, bwd_dv=3)
        # decays the same for every key (sm90-varlen-head runs them): 32-wide V blocks,
        # 32-token chunks, the chunk loop pipelined at 4 warps, as sm_80's; key blocks of
        # all of K, but a head gate's on 32 (sm_80's on 64)
        gamma = contract.check(*bf16, g_gamma=torch.zeros(2))
        sm90 = [fused_chunk.config(c) for c in (head, gamma)]
    sm80 = [fused_chunk.config(c) for c in (head, gamma)]
    assert [dict(c, BKI=0) for c in sm90] == [dict(c, BKI=0) for c in sm80]
    assert [c["BKI"] for c in sm90] == [32, 128] and [c["BKI"] for c in sm80] == [64, 128]
    assert [(c["BV"], c["BT"], c["num_warps"], c["stages"]) for c in sm90] == [(32, 32, 4, 3)] * 2
    assert_close(errs, "bfloat16")


@pytest.mark.parametrize("case", [SM90_CASES[0], SM90_CASES[1].with_(g="none")],
                         ids=("key", "reverse-none"))
def test_sm90_fp16_pipelined(case):
    """fp16 on a device of capability 9.x (faked): the forward on all of V with its chunk
    loop pipelined (key blocks and levels unrolled; 16-token chunks with per-key decays,
    `fused_chunk.config`), the dq, dk and dv walks pipelined (their level loops unrolled,
    `fused_chunk_bwd.config`; the dv walk with per-key decays on 16-token chunks, without
    gates on 32); forward and every gradient within fp16's tolerance of the oracle, with
    K = 96 and V = 100 padded, across several chunks."""
    with tuning.on_device("9.0 Fake GPU"):
        plan = cases.launch_env(case, backends.prepared(case, "float16", 0), "float16")[0]
        assert fused_chunk.config(plan) == dict(BK=128, BKI=128, BV=128, NV=1, num_warps=8,
                                                stages=3, BT=16 if case.g == "key" else 32)
        c = fused_chunk_bwd.config(plan)
        assert c["stages"] == dict(bwd_dq=3, bwd_dk=3, bwd_dv=3)
        assert c["chunks"]["bwd_dv"] == (16 if case.g == "key" else 32)
        errs = run_case(case, "float16", backward=True)
    assert_close(errs, "float16")


@pytest.mark.parametrize("case", SM90_CASES[1:], ids=lambda c: c.name)
def test_dk_in_the_dv_walk(case):
    """The device table's with_dk (a sweep candidate): where the dv walk has all of V it
    also writes dk', one reverse walk instead of two; against the oracle, reversed and
    varlen with an empty and a one-token sequence under a head gate."""
    with tuning.on_device("9.0 Fake GPU"), tuning.overriding(
            {("fused_chunk", "bwd_dv"): dict(with_dk=True, BT=16)}):
        arrays = backends.prepared(case, "bfloat16", 0)
        plan, _, _ = cases.launch_env(case, arrays, "bfloat16")
        walks = [ln.constexprs for ln in fused_chunk_bwd.launches(plan, True)
                 if ln.kernel is fused_chunk_bwd.fused_chunk_bwd_dkv_kernel]
        errs = run_case(case, "bfloat16", backward=True)
    assert [(w["DK"], w["DV"], w["BT"]) for w in walks] == [(True, True, 16)]
    assert_close(errs, "bfloat16")


def test_k_too_large_raises():
    qk = np.zeros((1, 2, 1, 513), np.float32)
    plan = contract.check(qk, qk, np.zeros((1, 2, 1, 8), np.float32))
    with pytest.raises(ValueError, match="^q: mode='fused_chunk' supports K <= 512"):
        fused_chunk.forward_launches(plan)


@pytest.mark.parametrize("K,NK,dtype", [(256, 1, np.float16), (257, 5, np.float16),
                                        (300, 5, np.float16), (320, 5, np.float16),
                                        (512, 8, np.float16), (64, 1, np.float32),
                                        (65, 2, np.float32), (100, 2, np.float32)])
def test_k_split_plan(K, NK, dtype):
    """Past K = 256 (64 in fp32) the forward runs ceil(K / 64) programs per (sequence x
    head, V block) and the partial sum, even where the sequence split is forced; up to
    there one launch (values against the oracle: tests/test_wide_heads.py,
    test_two_value_blocks_and_wide_k)."""
    qk = np.zeros((1, 64, 2, K), dtype)
    plan = contract.check(qk, qk, np.zeros((1, 64, 2, 40), dtype))
    with tuning.overriding({("fused_chunk", "split"): dict(segments=2)}):
        launches = fused_chunk.forward_launches(plan)
    if NK == 1:
        assert len(launches) == 3  # the forced sequence split
        return
    fwd, ksum = launches
    nv = fused_chunk.config(plan)["NV"]
    assert fwd.grid == (NK * nv * 2,) and fwd.constexprs["NS"] == 1
    assert fwd.writes()[0].shape == (1, 64, 2, NK, 40) and ksum.constexprs["NK"] == NK


def test_same_as_chunk_family_bf16():
    """Same math as mode="chunk" (independent of the oracle): in bf16 the two land within
    bf16's tolerance of each other (their 16-bit operands are rounded at different
    chunk boundaries, 32 and 64 tokens)."""
    case = C("vs-chunk", T=100, H=2, Hk=2, K=16, V=16, g="key", initial_state=True)
    arrays = backends.prepared(case, "bfloat16", 1)
    got = run_family(case, arrays, "bfloat16")
    t = cases.to_torch(arrays, torch.bfloat16)
    plan = contract.check(**cases.call_kwargs(case, t))
    env = dict(t)
    torch_runner.run(family("chunk").forward_launches(plan), env)
    assert rel_err(got["o"], env["o"].float().numpy()) < tolerance("bfloat16")
    assert rel_err(got["final_state"], env["final_state"].numpy()) < tolerance("bfloat16")


PUBLIC = C("public", H=2, Hk=1, K=8, V=8, seqlens=(70, 0, 5), g="key", gv=True,
           g_gamma="seq", initial_state=True, packed=True)


PUBLIC_ON_CHIP = C("public-on-chip", H=2, Hk=1, K=8, V=8, seqlens=(40, 0, 5), g="key",
                   gk=True, initial_state=True, packed=True)


@pytest.mark.parametrize("case", [PUBLIC, PUBLIC_ON_CHIP], ids=lambda c: c.name)
@pytest.mark.parametrize("backend", ["torch-triton-fused-chunk", "jax-triton-fused-chunk"])
def test_public_call_by_name(backend, case):
    """mode="fused_chunk" through the public torch_side / jax_side functions (their
    parity backends): o, final state and every gradient against the oracle."""
    b = {x.name: x for x in backends.all_backends()}[backend]
    if b.unavailable():
        pytest.skip(b.unavailable())
    arrays = backends.prepared(case, "float32", 0)
    assert_close(errors(b.run(case, arrays, "float32"), ORACLE.run(case, arrays, "float32")),
                 "float32")


def test_dispatch_by_name_only():
    """By name on any platform that runs Triton ("auto" resolves to it, as for the fused
    recurrent kernel); never chosen by mode="auto"; the frameworks' chunked paths refuse
    it with a ValueError naming mode."""
    from bridge import dispatch

    assert "fused_chunk" in dispatch.MODES
    plan = contract.check(np.zeros((1, 4096, 1, 8), np.float32),
                          np.zeros((1, 4096, 1, 8), np.float32),
                          np.zeros((1, 4096, 1, 8), np.float32))
    assert dispatch.kernel_mode("fused_chunk", plan) == "fused_chunk"
    assert dispatch.kernel_mode("auto", plan) == "chunk"
    assert dispatch.route("auto", "fused_chunk", ("auto", "triton", "torch"), "torch",
                          gpu=False) == "triton"
    with pytest.raises(ValueError, match="^mode: 'fused_chunk' is a Triton kernel"):
        dispatch.route("torch", "fused_chunk", ("auto", "triton", "torch"), "torch", gpu=False)
