"""The chunked backward kernels (bridge/kernels/chunk_bwd.py) against the float64
oracle, beyond tests/test_triton_chunk.py's feature cases: the precision cases
of issue 35 (float16, strong gates, short sequences) and of the level products
(long sequences, strong gates), gates given in the inputs' own 16-bit dtype
(the exact one-piece scans), the scan table against its closed form, and its row
sums of values past fp16's range.

Interpreted on this CPU machine (Triton's interpreter).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import bridge.kernels  # noqa: E402,F401  (decides the interpreter before triton is imported)
from bridge import contract, grads, torch_runner  # noqa: E402
from bridge.kernels import chunk, chunk_scan  # noqa: E402
from parity import backends, cases  # noqa: E402
from parity.compare import assert_close, errors, tolerance  # noqa: E402
import triton.language as tl  # noqa: E402

ORACLE = backends.Oracle()
C = cases.Case
GATES = ("g", "gk", "gv")


def run_case(case, dtype, seed=0, gates_like_q=False, want=None):
    """{quantity: relative error} of the chunk launch lists against the oracle on
    the same inputs (activations rounded to `dtype`; with `gates_like_q` the
    log gates too, and handed to the kernels in that dtype); `want`: the oracle's
    result on those inputs, where the caller has it."""
    arrays = backends.prepared(case, dtype, seed)
    if gates_like_q:
        arrays = {n: backends.round_to(a, dtype) if n in GATES else a for n, a in arrays.items()}
    t = cases.to_torch(arrays, getattr(torch, dtype))
    if gates_like_q:
        t = {n: x.to(getattr(torch, dtype)) if n in GATES else x for n, x in t.items()}
    env = dict(cases.call_kwargs(case, t))
    plan = contract.check(**env)
    env["do"], env["dfinal_state"] = t["do"], t["dfinal_state"]
    torch_runner.run(chunk.forward_launches(plan), env)
    torch_runner.run(chunk.backward_launches(plan, True), env)
    got = {"o": env["o"], "final_state": env["final_state"]}
    got.update({"d" + n: x for n, x in grads.assemble(plan, env).items()})
    got = {n: x.float().numpy() for n, x in got.items()}
    want = ORACLE.run(case, arrays, dtype) if want is None else want
    return errors(got, want, case.gate_grad_floor)


# issue 35: drawn by the deep property profile, float16, seed 113; the chunk kernels
# gave dgk 4.8e-3 (T=3), 9.1e-3 (T=5), dg 7.0e-3 (reverse) against a 4e-3 tolerance,
# every other path under 1e-3. The carried gate-gradient term now pairs the state
# gradient with the same rounded products as dk' (chunk_dqk_kernel's docstring).
ISSUE_35 = C("issue-35", B=2, T=3, H=2, Hk=2, K=3, V=3, g="head", gk=True, g_gamma="head",
             initial_state=True, gate_scale=3.0)


@pytest.mark.parametrize("case", [ISSUE_35, ISSUE_35.with_(name="T5", T=5),
                                  ISSUE_35.with_(name="reverse", reverse=True),
                                  ISSUE_35.with_(name="T130", T=130)], ids=lambda c: c.name)
def test_issue_35_float16_gate_gradients(case):
    """Within float16's tolerance; dg and dgk within 1e-3 (measured <= 3.2e-4: one
    float16 rounding of the gated tensor-core operands), and dg_gamma, the sum of dg
    over batch and time, within 1e-3 times that sum's cancellation ratio
    ||dg|| / ||dg_gamma|| of the float64 gradients (T130, seed 113: ratio 3.3, error
    1.2e-3; seed 1: 5.0, 1.2e-3)."""
    want = ORACLE.run(case, backends.prepared(case, "float16", 113), "float16")
    errs = run_case(case, "float16", seed=113, want=want)
    assert_close(errs, "float16")
    assert max(errs["dg"], errs["dgk"]) <= 1e-3, errs
    ratio = np.linalg.norm(want["dg"]) / np.linalg.norm(want["dg_gamma"])
    assert errs["dg_gamma"] <= 1e-3 * max(1.0, ratio), (ratio, errs)


def test_long_sequence_strong_gates_bfloat16():
    """T = 1024, log gates -0.2..-10 a step, bf16: the level products take q F and
    k F in two bf16 pieces; in one piece dg's error was 1.7e-2 (2.6x the earlier
    kernels' 4.7e-3), in two 3.4e-3 (SPEC.md, precision of the chunked backward)."""
    case = C("long-strong", T=1024, H=1, Hk=1, K=32, V=32, g="key", initial_state=True,
             gate_scale=10.0)
    errs = run_case(case, "bfloat16")
    assert_close(errs, "bfloat16")
    assert errs["dg"] <= 8e-3, errs


def test_value_gate_over_several_value_blocks():
    """With gv in 16 bits chunk_dA_kernel and chunk_dv_kernel take V in blocks of
    chunk.GV_BV columns: V = 80 is three blocks, the last one ragged, each with its own
    value-side decays."""
    case = C("gv-blocks", B=1, T=130, H=2, Hk=1, K=16, V=80, g="key", gv=True,
             initial_state=True)
    plan = contract.check(**cases.call_kwargs(case, cases.to_torch(
        backends.prepared(case, "bfloat16", 0), torch.bfloat16)))
    bwd = {x.kernel.__name__: x for x in chunk.backward_launches(plan, True)}
    assert bwd["chunk_dv_kernel"].grid[1] == -(-80 // chunk.GV_BV) == 3
    assert bwd["chunk_dA_kernel"].constexprs["BV"] == chunk.GV_BV
    assert_close(run_case(case, "bfloat16"), "bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("gates", [dict(g="key"), dict(gk=True), dict(gv=True)],
                         ids=lambda g: next(iter(g)))
def test_gates_in_the_inputs_dtype(dtype, gates):
    """A single gate given in q's 16-bit dtype is scanned in one exact piece
    (chunk_scan.decay_pieces); gates elsewhere in these tests are fp32 (three)."""
    case = C("gate-like-q", T=150, H=2, Hk=1, K=16, V=16, initial_state=True, **gates)
    assert_close(run_case(case, dtype, gates_like_q=True), dtype)


@triton.jit
def _table_kernel(tab, BT: tl.constexpr, LEVELS: tl.constexpr):
    i = tl.program_id(0)
    o_t = tl.arange(0, BT)
    tl.store(tab + i * BT * BT + o_t[:, None] * BT + o_t[None, :],
             chunk_scan.scan_matrix(i, BT, LEVELS, tl.float32))


def _table():
    t = torch.empty((2 * chunk.LEVELS + 3, chunk.BT, chunk.BT), dtype=torch.float32)
    _table_kernel[(t.shape[0],)](t, BT=chunk.BT, LEVELS=chunk.LEVELS)
    return t.numpy()


def test_scan_table_closed_form():
    """Every pair s < t of a chunk is in exactly one level l (the highest bit in
    which t and s differ), and there F_l(t) F_l(s), F_l = exp(M_l a), is the
    decay exp(sum_{s < r <= t} a_r), for random log decays a; the chunk-start
    and chunk-end matrices sum a from the start to t and after t to the end."""
    tab = _table()
    L, BT = chunk.LEVELS, chunk.BT
    assert set(np.unique(tab)) == {0.0, 1.0}
    a = -np.random.default_rng(0).uniform(0.0, 2.0, BT)
    csum = np.concatenate([[0.0], np.cumsum(a)])  # csum[t + 1] = sum_{r <= t} a_r
    pairs = sum(tab[L + 2 + lw] for lw in range(L))
    np.testing.assert_array_equal(pairs, np.tril(np.ones((BT, BT)), -1))
    np.testing.assert_array_equal(tab[2 * L + 2], np.tril(np.ones((BT, BT)), -1))
    for lw in range(L):
        f = tab[lw] @ a
        assert np.all(f <= 0)  # sums of decays <= 0: every factor <= 1
        for t, s in zip(*np.nonzero(tab[L + 2 + lw])):
            assert (t ^ s) >> lw == 1
            np.testing.assert_allclose(f[t] + f[s], csum[t + 1] - csum[s + 1], atol=1e-12)
    np.testing.assert_allclose(tab[L] @ a, csum[1:], atol=1e-12)
    np.testing.assert_allclose(tab[L + 1] @ a, csum[-1] - csum[1:], atol=1e-12)


@triton.jit
def _sum_rows_kernel(tab, x, out, BT: tl.constexpr, D: tl.constexpr, LEVELS: tl.constexpr):
    o_t, o_d = tl.arange(0, BT), tl.arange(0, D)
    b_x = tl.load(x + o_t[:, None] * D + o_d[None, :])
    for j in range(0, 2):
        tl.store(out + j * BT * D + o_t[:, None] * D + o_d[None, :],
                 chunk_scan.sum_rows(tab, LEVELS + j, b_x, BT))


def test_row_sums_of_values_past_fp16_range():
    """sum_rows on a float16 scan table (fp16 inputs' table) with fp32 summands from
    1e-3 to 1e7 of both signs (a gate gradient's, where fp16 outputs overflow): the
    sums over rows r >= t and r < t, finite and within fp32 accumulation of the
    float64 sums (fp16 pieces of the summands were inf and gave NaN in every row)."""
    BT, D = chunk.BT, 16
    tab = torch.from_numpy(_table()).to(torch.float16)
    rng = np.random.default_rng(0)
    x = (rng.choice([-1.0, 1.0], (BT, D)) * 10.0 ** rng.uniform(-3, 7, (BT, D))).astype(
        np.float32)
    out = torch.empty((2, BT, D), dtype=torch.float32)
    _sum_rows_kernel[(1,)](tab, torch.from_numpy(x), out, BT=BT, D=D, LEVELS=chunk.LEVELS)
    x64 = x.astype(np.float64)
    later = np.cumsum(x64[::-1], 0)[::-1]  # rows r >= t
    want = np.stack([later, later[0][None, :] - later])  # r < t: all rows minus r >= t
    got = out.numpy().astype(np.float64)
    assert np.isfinite(got).all()
    scale = np.abs(x64).sum(0)  # fp32 accumulation: error relative to the summands
    err = np.max(np.abs(got - want) / scale)
    assert err < BT * 2.0 ** -24, err  # n-term fp32 sums


def test_strong_gates_fp32_stay_at_scan_precision():
    """fp32 with log gates of -0.2..-10 a step over several chunks: the level
    factors are exponentials of sums of consecutive decays only, so o and the
    gradients stay at fp32 scan level (value gates and the key gate both)."""
    case = C("strong", T=200, H=1, Hk=1, K=16, V=16, g="key", gv=True, initial_state=True,
             gate_scale=10.0, gate_grad_floor=0.1)
    errs = run_case(case, "float32")
    assert_close(errs, "float32")
    assert max(errs[n] for n in ("dq", "dk", "dv")) < tolerance("float32") / 10, errs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_op_reuses_the_forwards_A(dtype, monkeypatch):
    """torch_side.recurrent(mode="chunk") under autograd: the op keeps the forward's A
    (chunk.kept: in q's dtype for bfloat16) and its backward reads it, launching no intra-chunk
    kernel; its gradients equal those of the backward that recomputes A
    (GLA_BRIDGE_CHUNK_KEEP=inputs) exactly, and the float64 oracle's within `dtype`'s
    tolerance. Packed sequences, one crossing a chunk boundary."""
    from torch_side import triton_launch

    launched = []  # per launch list run by the torch op: its kernels' names
    real_run = triton_launch.run

    def counting_run(launches, env, **kw):
        launched.append([launch.kernel.__name__ for launch in launches])
        return real_run(launches, env, **kw)

    monkeypatch.setattr(triton_launch, "run", counting_run)
    case = C("kept-A", H=2, Hk=1, K=8, V=8, g="key", initial_state=True,
             seqlens=(70, 5), packed=True)
    arrays = backends.prepared(case, dtype, seed=3)
    torch_chunk = backends.TorchBackend("triton", "chunk")
    kept = torch_chunk.run(case, arrays, dtype)
    (fwd_kernels, bwd_kernels), launched[:] = launched, []
    assert "chunk_intra_kernel" in fwd_kernels and "chunk_intra_kernel" not in bwd_kernels

    monkeypatch.setenv("GLA_BRIDGE_CHUNK_KEEP", "inputs")
    recomputed = torch_chunk.run(case, arrays, dtype)
    assert "chunk_intra_kernel" in launched[1], launched
    for n, x in recomputed.items():
        np.testing.assert_array_equal(kept[n], x, err_msg=n)
    assert_close(errors(kept, ORACLE.run(case, arrays, dtype), case.gate_grad_floor), dtype)
