"""The chunked Triton kernels (mode="chunk") against the float64 oracle:
outputs, final state and every gradient, run through bridge.torch_runner and
bridge.grads.assemble directly (the launchers' wiring is tested elsewhere).

On this CPU machine they run in Triton's interpreter. Chunks are 64 tokens with
16-token sub-chunks: the short cases end mid-sub-chunk inside one chunk, the
multi-chunk cases (T = 129, 150, 200; varlen 0/70/130) cross chunk boundaries
with sequences ending mid-chunk.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import bridge.kernels  # noqa: E402,F401  (decides the interpreter before triton is imported)
from bridge import contract, dispatch, grads, torch_runner  # noqa: E402
from bridge.kernels import chunk, common  # noqa: E402
from parity import backends, cases  # noqa: E402
from parity.compare import assert_close, errors, rel_err, tolerance  # noqa: E402
import triton.language as tl  # noqa: E402

ORACLE = backends.Oracle()


def run_chunk(case, arrays, dtype, use_dht=True):
    """{o, final_state, d<input>} from the chunk launch lists, as float32 NumPy
    in each input's shape."""
    plan, env, t = cases.launch_env(case, arrays, dtype)
    torch_runner.run(chunk.forward_launches(plan), env)
    assert env["o"].dtype == t["q"].dtype and env["final_state"].dtype == torch.float32
    if not use_dht:
        env.pop("dfinal_state")
    torch_runner.run(chunk.backward_launches(plan, use_dht), env)
    out = {"o": env["o"], "final_state": env["final_state"]}
    out.update({"d" + n: gr for n, gr in grads.assemble(plan, env).items()})
    return {n: x.float().numpy().reshape(arrays["do" if n == "o" else n[1:]].shape
                                         if n != "final_state" else x.shape)
            for n, x in out.items()}


def run_case(case, dtype="float32", seed=0, use_dht=True):
    """{quantity: relative error} of the kernels against the oracle, both given
    the same inputs rounded to `dtype`."""
    arrays = backends.prepared(case, dtype, seed)
    if not use_dht:
        arrays["dfinal_state"] = np.zeros_like(arrays["dfinal_state"])
    got = run_chunk(case, arrays, dtype, use_dht)
    want = ORACLE.run(case, arrays, dtype)
    assert set(got) == set(want), (sorted(got), sorted(want))
    return errors(got, want, case.gate_grad_floor)


C = cases.Case
# 16-token blocks: T = 20 and 36 end mid-block; sequences of 0, 1, 17, 30 tokens
FEATURES = [
    C("plain", T=36),
    C("g-head", T=20, g="head"),
    C("g-key", T=20, H=1, Hk=1, g="key"),
    C("gk", T=20, H=1, Hk=1, gk=True),
    C("gv", T=20, gv=True),
    C("gamma-head", T=20, g_gamma="head"),
    C("gamma-seq", B=2, T=20, H=1, Hk=1, g_gamma="seq"),
    C("initial-state", B=2, T=20, H=1, Hk=1, initial_state=True),
    C("reverse", T=36, H=1, Hk=1, g="key", gv=True, initial_state=True, reverse=True),
    C("varlen", H=1, Hk=1, seqlens=(17, 0, 30, 1), g="key", gv=True, initial_state=True,
      packed=True),
    C("varlen-reverse", H=1, Hk=1, seqlens=(17, 0, 20), gk=True, initial_state=True,
      reverse=True),
    C("gqa", T=20, H=4, Hk=2, K=6, V=10, g="head"),
    C("odd-kv", T=20, H=1, Hk=1, K=33, V=40, gk=True, gv=True, initial_state=True),
    C("scale", T=20, H=1, Hk=1, g="head", softmax_scale=0.3),
    C("everything", H=2, Hk=1, K=5, V=7, g="key", gk=True, gv=True, g_gamma="seq",
      initial_state=True, reverse=True, seqlens=(20, 1, 0, 18), packed=True),
]


@pytest.mark.parametrize("case", FEATURES, ids=lambda c: c.name)
def test_features_fp32(case):
    assert_close(run_case(case), "float32")


# Several 64-token chunks, small K/V to keep the interpreter quick.
MULTI_CHUNK = [
    C("t129-key-gv-h0", T=129, H=2, Hk=1, K=8, V=12, g="key", gv=True, initial_state=True),
    C("t150-head-gamma-rev", B=2, T=150, H=2, Hk=2, K=8, V=8, g="head", g_gamma="head",
      reverse=True),
    C("t200-gk-gamma-seq", T=200, H=1, Hk=1, K=16, V=8, gk=True, g_gamma="seq",
      initial_state=True),
    C("varlen-0-70-130", H=2, Hk=1, K=8, V=8, seqlens=(0, 70, 130), g="key", gk=True, gv=True,
      g_gamma="seq", initial_state=True, packed=True),
    C("varlen-rev-odd", H=1, Hk=1, K=5, V=70, seqlens=(70, 1, 65), g="head", gv=True,
      initial_state=True, reverse=True),
]


@pytest.mark.parametrize("case", MULTI_CHUNK, ids=lambda c: c.name)
def test_several_chunks_fp32(case):
    assert_close(run_case(case), "float32")


@pytest.mark.parametrize("case", [
    C("t1-head", T=1, H=4, Hk=1, K=8, V=16, g="head"),
    C("t1-k1-all", T=1, H=2, Hk=2, K=1, V=4, g="key", gk=True, gv=True, g_gamma="seq"),
    C("t1-h0", T=1, H=2, Hk=2, K=1, V=4, g="head", gv=True, initial_state=True),
    C("ones-varlen", H=2, Hk=1, K=4, V=4, seqlens=(1, 0, 1), g="head", gv=True,
      g_gamma="head", packed=True),
], ids=lambda c: c.name)
def test_one_step_gate_gradients(case):
    """One-token sequences: with no initial state the first decay multiplies a
    zero state, so every gate gradient is exactly 0 (the oracle's too); fp32
    noise of cancelled terms there would be an infinite relative error. Judged
    with a floor of 1e-30 instead of the usual absolute fallback."""
    arrays = backends.prepared(case, "float32", 0)
    got = run_chunk(case, arrays, "float32")
    want = ORACLE.run(case, arrays, "float32")
    for name in ("dg", "dgk", "dgv", "dg_gamma"):
        if name in want:
            if not np.any(want[name]):
                assert not np.any(got[name]), (name, got[name])
            else:
                assert rel_err(got[name], want[name], 1e-30) <= tolerance("float32"), name
    assert_close(errors(got, want), "float32")


@pytest.mark.parametrize("T", [36, 150])
def test_strong_gates_scan_precision(T):
    """Log gates of -0.2..-10 a step (sums of several hundred over a chunk): every
    exponent is a sum of consecutive log gates, <= 0, never a difference of two
    long running sums, so the error stays at fp32 scan level."""
    case = C("strong", T=T, H=1, Hk=1, K=16, V=16, g="key", gv=True, initial_state=True,
             gate_scale=10.0, gate_grad_floor=0.1)
    errs = run_case(case)
    assert all(np.isfinite(v) for v in errs.values()), errs
    assert_close(errs, "float32")
    assert errs["o"] < 2e-6, errs


def test_very_strong_gates_stay_finite():
    case = C("very-strong", T=12, H=1, Hk=1, g="key", gk=True, gv=True, g_gamma="head",
             initial_state=True, gate_scale=1e4)
    errs = run_case(case)
    assert all(np.isfinite(v) for v in errs.values()), errs
    assert_close(errs, "float32")


def test_without_final_state_cotangent():
    case = C("no-dht", T=24, H=1, Hk=1, g="key", gv=True, g_gamma="head", initial_state=True)
    assert_close(run_case(case, use_dht=False), "float32")


@pytest.mark.parametrize("seqlens", [(17, 0, 30), (200, 70)])
def test_gamma_gradient_precision(seqlens):
    """dg_gamma [N,H] from the derivative of each chunk's decay factors (not a
    sum of reverse cumulative sums, whose terms cancel): within the fp32 tolerance
    on short and multi-chunk sequences (9.9e-6 and 7e-7 measured)."""
    case = C("gamma", H=1, Hk=1, seqlens=seqlens, gk=True, g_gamma="seq", initial_state=True,
             reverse=True)
    assert_close(run_case(case), "float32")


@pytest.mark.parametrize("T", [20, 150])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision(dtype, T):
    """bf16/fp16 operands go to tl.dot as such (fp32 accumulation); the oracle runs
    on the same rounded inputs, so what remains is the kernels' own rounding of
    dot operands (8 / 11 mantissa bits) and of the stored outputs and states
    (parity.compare's tolerance for the dtype: 3e-2 / 4e-3)."""
    case = C("low", T=T, H=2, Hk=1, K=16, V=24, g="key", gv=True, initial_state=True)
    assert_close(run_case(case, dtype), dtype)


def test_two_value_and_key_blocks():
    """K = 100, V = 80 in fp32: two K blocks of 64 and three V blocks of 32."""
    case = C("blocks", T=72, H=1, Hk=1, K=100, V=80, g="head", gv=True, initial_state=True)
    c = chunk.config(contract.check(np.zeros((1, 1, 1, 100), np.float32),
                                    np.zeros((1, 1, 1, 100), np.float32),
                                    np.zeros((1, 1, 1, 80), np.float32)))
    assert (c["NK"], c["NV"]) == (2, 3)
    assert_close(run_case(case), "float32")


@triton.jit
def _offsets_kernel(cu_seqlens, T, N, slot_base, out_rows, out_state,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    LOG_N: tl.constexpr):
    """The offsets every chunk kernel forms, from the helpers they use: a token
    row's last element (row * H + h) * K + K - 1, and its chunk slot's last state
    element ((slot * H + h) * K + K - 1) * V + V - 1."""
    i_s = slot_base + tl.program_id(0)
    i_n, bos, eos, p0 = common.slot_chunk(cu_seqlens, i_s, T, N, BT, True, LOG_N)
    rows, mask = common.block_rows(bos, eos, p0, BT, False)
    o_t = tl.arange(0, BT)
    tl.store(out_rows + tl.program_id(0) * BT + o_t, (rows * H + H - 1) * K + K - 1, mask=mask)
    slot = common.first_slot(cu_seqlens, i_n, T, BT, True) + p0 // BT
    tl.store(out_state + tl.program_id(0), ((slot * H + H - 1) * K + K - 1) * V + V - 1)


def test_offsets_are_int64_past_2_31():
    """Packed rows near 2^24 with H=4, K=V=64: token offsets reach 4.3e9 and state
    offsets 4.3e9, past int32. Launched on a few tiny tiles (no large tensors):
    the helpers' offsets equal Python's integers, so none wraps at 2^31."""
    H, K, V, BT = 4, 64, 64, chunk.BT
    start = 2 ** 24 - 40
    cu = torch.tensor([0, start, 2 ** 24 + 100], dtype=torch.int32)
    total, n_seq = int(cu[-1]), 2
    slot_base = start // BT + 1  # the second sequence's first slot
    n_prog = 3
    rows = torch.full((n_prog * BT,), -1, dtype=torch.int64)
    state = torch.full((n_prog,), -1, dtype=torch.int64)
    _offsets_kernel[(n_prog,)](cu, total, n_seq, slot_base, rows, state, H=H, K=K, V=V, BT=BT,
                               LOG_N=2)
    want_rows = [((start + p) * H + H - 1) * K + K - 1 for p in range(140)]
    got = [int(x) for x in rows.tolist() if x >= 0]
    assert got == want_rows and max(got) > 2 ** 32
    want_state = [(((slot_base + c) * H + H - 1) * K + K - 1) * V + V - 1 for c in range(n_prog)]
    assert [int(x) for x in state] == want_state and want_state[0] > 2 ** 32


def test_head_dims_past_the_limit_raise():
    """K or V past 512 (dispatch.HEAD_DIMS): a ValueError naming q or v from the plans."""
    qk, v = np.zeros((1, 2, 1, 513), np.float32), np.zeros((1, 2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="^q: mode='chunk' supports K <= 512, got K=513"):
        chunk.forward_launches(contract.check(qk, qk, v))
    qk, v = np.zeros((1, 2, 1, 8), np.float32), np.zeros((1, 2, 1, 600), np.float32)
    with pytest.raises(ValueError, match="^v: mode='chunk' supports V <= 512, got V=600"):
        chunk.backward_launches(contract.check(qk, qk, v), use_dht=True)


def test_autotuned_launch_matches_the_plan_config(monkeypatch):
    """The CUDA torch launch's autotune path, run here in the interpreter with a
    stand-in timer under which 8 warps and 2 stages are fastest: every kernel of
    the forward and backward goes through triton.autotune over its own configs,
    picks that one, and gives the plan config's numbers (warps do not change
    the math)."""
    from triton.runtime.autotuner import Autotuner

    case = C("tuned", T=70, H=2, Hk=1, K=8, V=8, g="key", gv=True, g_gamma="seq",
             initial_state=True)
    t = cases.to_torch(cases.inputs(case))
    plan = contract.check(**cases.call_kwargs(case, t))
    launches = chunk.forward_launches(plan) + chunk.backward_launches(plan, True)

    timed = []
    orig = Autotuner._bench

    def spy(self, *args, config, **meta):
        timed.append((self.fn.__name__, config))
        return orig(self, *args, config=config, **meta)

    def bench(fn, quantiles=None, **kw):
        cfg = timed[-1][1]
        return 0.5 if (cfg.num_warps, cfg.num_stages) == (8, 2) else 1.0

    monkeypatch.setattr(Autotuner, "_bench", spy)
    plain = torch_runner.run(launches, dict(t), autotune=False)
    tuned = torch_runner.run(launches, dict(t), autotune=True, do_bench=bench)
    assert {n for n, _ in timed} == {launch.kernel.__name__ for launch in launches}
    variants = {(launch.kernel.__name__, repr(sorted(launch.constexprs.items())))
                for launch in launches}  # a variant met again reuses its choice
    assert len(timed) == len(torch_runner.CONFIGS) * len(variants) < 9 * len(launches)
    for launch in launches:
        best = torch_runner.tuned(launch, bench).best_config
        assert (best.num_warps, best.num_stages) == (8, 2)
    for name in ("o", "final_state", "dq", "dk_h", "dv_h", "da", "db", "dgamma"):
        assert torch.equal(plain[name], tuned[name]), name


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_float64_inputs(mode):
    """float64 inputs (the contract takes them) through both Triton families:
    o in float64, fp32 accumulation, against the oracle at fp32 tolerance."""
    import torch_side
    from parity import oracle

    _, x = cases.make(T=70, g="key")
    q, k, v, g = (cases.cast(x, np.float64)[n] for n in ("q", "k", "v", "g"))
    t = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v, g)]
    o, s = torch_side.recurrent_gla(*t, platform="triton", mode=mode)
    o.sum().backward()
    want_o, want_s = oracle.recurrent_gla(q, k, v, g=g)
    assert o.dtype == torch.float64 and t[3].grad.dtype == torch.float64
    assert rel_err(o.detach().numpy(), want_o) < 2e-5
    assert rel_err(s.detach().numpy(), want_s) < 2e-5
    want = oracle.recurrent_grads(q, k, v, g=g, do=np.ones_like(want_o),
                                  dfinal_state=np.zeros_like(want_s))
    assert rel_err(t[3].grad.numpy(), want["g"]) < 2e-5


def test_cost_rule_uses_the_kernels_chunk_length():
    """dispatch.kernel_costs counts state-pass steps in chunks of the kernels' own
    length (the contract cannot import the Triton kernels to read it)."""
    assert dispatch.CHUNK_LEN == chunk.BT


def test_unknown_family_and_compiled_cpu_launch_are_named_errors(monkeypatch):
    """`kernels.family` accepts only a resolved family; a CPU launch while Triton
    runs compiled (imported before bridge.kernels) says why instead of failing
    inside Triton."""
    from bridge import kernels

    with pytest.raises(ValueError, match="^mode:"):
        kernels.family("auto")
    case = cases.Case("cpu-compiled", H=2, Hk=2, K=16, V=16)
    a = cases.inputs(case)
    plan = contract.check(a["q"], a["k"], a["v"])
    t = cases.to_torch({n: a[n] for n in ("q", "k", "v")})
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        torch_runner.run(kernels.family("chunk").forward_launches(plan), t)


@triton.jit
def _seg_kernel(out, H: tl.constexpr, BT: tl.constexpr):
    o_t = tl.arange(0, BT)
    c = common.seg_matrix(o_t, H, tl.float32)
    tl.store(out + o_t[:, None] * BT + o_t[None, :], c.to(tl.float32))


def test_seg_matrices_sum_consecutive_decays():
    """common.seg_matrix against sums written out here: level h (BT/2 .. 1)
    sums, for a row t with bit h set, its aligned segment of h from the start to
    t, else t+1 to the segment's end; h = BT the chunk's reverse exclusive sums,
    h = 2 BT its inclusive sums. Applied to random decays, as seg_sums does."""
    BT = chunk.BT
    x = np.random.default_rng(0).standard_normal(BT)
    for h in [BT >> i for i in range(1, BT.bit_length())] + [BT, 2 * BT]:
        out = torch.empty(BT, BT)
        _seg_kernel[(1,)](out, H=h, BT=BT)
        got = out.numpy()
        want = []
        for t in range(BT):
            if h > BT:
                want.append(x[:t + 1].sum())
            elif h == BT:
                want.append(x[t + 1:].sum())
            else:
                start = t - t % h
                want.append(x[start:t + 1].sum() if t & h else x[t + 1:start + h].sum())
        assert set(np.unique(got)) <= {0.0, 1.0}, h
        np.testing.assert_allclose(got @ x, np.array(want), rtol=0, atol=1e-12, err_msg=str(h))


def test_grids_within_cuda_limits_for_many_sequences():
    """4,096 packed sequences x 16 heads (N*H = 65,536): every chunk launch,
    forward and backward, has a grid CUDA accepts (x < 2^31, y and z <= 65,535)."""
    N, H = 4096, 16
    q = np.zeros((1, 8 * N, H, 64), np.float32)
    cu = np.arange(0, 8 * N + 1, 8, dtype=np.int32)
    for kw in ({}, dict(g=np.zeros((1, 8 * N, H, 64), np.float32),
                        gv=np.zeros((1, 8 * N, H, 64), np.float32))):
        plan = contract.check(q, q, q, cu_seqlens=cu, initial_state=np.zeros((N, H, 64, 64),
                                                                               np.float32), **kw)
        for launch in chunk.forward_launches(plan) + chunk.backward_launches(plan, True):
            grid = tuple(launch.grid) + (1, 1)
            assert grid[0] < 2 ** 31 and max(grid[1:3]) <= 65535, (launch.kernel.__name__, grid)
