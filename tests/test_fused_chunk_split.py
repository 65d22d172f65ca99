"""fused_chunk's split forward (bridge/kernels/fused_chunk_split.py): each sequence cut
into segments run by separate programs, their states combined. Forced to 2, 3 and more
segments than a sequence has chunks (empty segments), in Triton's interpreter: o and the
final state against the float64 oracle and against the unsplit launch (within fp32
rounding), on every gate kind, reverse, initial state, varlen with empty and one-token
sequences, GQA, the three dtypes, strong and -inf gates; a gradient through the
family's backward after a split forward; and the split factor's rule on a device of
known SM count (a faked one), the CPU's default and a forced or bad knob."""

import math
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import bridge.kernels  # noqa: E402,F401  (decides the interpreter before triton is imported)
from bridge import grads, torch_runner, tuning  # noqa: E402
from parity.compiled import report  # noqa: E402
from bridge.kernels import family, fused_chunk  # noqa: E402
from bridge.kernels import fused_chunk_split as split  # noqa: E402
from parity import backends, cases  # noqa: E402
from parity.compare import assert_close, errors, rel_err  # noqa: E402

ORACLE = backends.Oracle()
FORWARD = ("o", "final_state")
C = cases.Case
SITE = ("fused_chunk", "split")
# fp32 rounding of a reordered state sum: the split and unsplit launches differ there only
SAME = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1e-2}


def run(case, arrays, dtype, segments, backward=False):
    """{o, final_state[, d<input>]} of fused_chunk's launch lists with the split forced
    to `segments`, float32 NumPy in each quantity's shape; and the forward's kernels."""
    plan, env, t = cases.launch_env(case, arrays, dtype)
    mod = family("fused_chunk")
    with tuning.overriding({SITE: dict(segments=segments)}):
        launches = mod.forward_launches(plan)
    torch_runner.run(launches, env)
    assert env["o"].dtype == t["q"].dtype and env["final_state"].dtype == torch.float32
    out = {"o": env["o"], "final_state": env["final_state"]}
    if backward:
        torch_runner.run(mod.backward_launches(plan, True, mod.kept(plan)), env)
        out.update({"d" + n: gr for n, gr in grads.assemble(plan, env).items()})
    got = {n: x.float().numpy().reshape(arrays["do" if n == "o" else n[1:]].shape
                                        if n != "final_state" else x.shape)
           for n, x in out.items()}
    return got, [ln.kernel.__name__ for ln in launches]


def check(case, dtype="float32", splits=(2, 3, 7), arrays=None):
    """Each split against the oracle (the dtype's tolerance) and the unsplit launch."""
    arrays = backends.prepared(case, dtype, 0) if arrays is None else arrays
    want = {n: ORACLE.run(case, arrays, dtype)[n] for n in FORWARD}
    base, kernels = run(case, arrays, dtype, 1)
    assert kernels == ["fused_chunk_fwd_kernel"]
    for ns in splits:
        got, kernels = run(case, arrays, dtype, ns)
        assert kernels == ["fused_chunk_fwd_kernel", "fused_chunk_combine_kernel",
                           "fused_chunk_fwd_kernel"]
        errs = errors(got, want)
        assert all(np.isfinite(e) for e in errs.values()), (ns, errs)
        assert_close(errs, dtype)
        for n in FORWARD:
            assert rel_err(got[n], base[n]) <= SAME[dtype], (ns, n, rel_err(got[n], base[n]))


# 32-token chunks: T = 100 is 4 chunks (the last 4 tokens), so 7 segments leave 3 empty.
# Weak gates (-0.002..-0.02 a step): a segment's incoming state is not decayed away, so a
# wrong combine shows (the stock -0.02..-1 leaves e^-16 of it after one segment).
CASES = [c.with_(gate_scale=0.02) for c in [
    C("plain-gqa", T=100, H=4, Hk=2, K=8, V=8),
    C("g-head-h0", T=100, H=2, Hk=1, K=8, V=8, g="head", initial_state=True),
    C("g-key-gv", T=100, H=1, Hk=1, K=8, V=12, g="key", gv=True),
    C("gk-gamma-seq-h0", B=2, T=70, H=1, Hk=1, K=8, V=8, gk=True, g_gamma="seq",
      initial_state=True),
    C("gamma-head-rev", T=100, H=2, Hk=2, K=8, V=8, g_gamma="head", reverse=True),
    C("gv-rev-h0", T=100, H=1, Hk=1, K=8, V=8, gv=True, initial_state=True,
      reverse=True),
    C("gamma-head-gv-h0", T=100, H=2, Hk=1, K=8, V=8, g_gamma="head", gv=True,
      initial_state=True),
    # varlen: 3, 1, 0 and 2 chunks, one token, empty
    C("varlen-everything", H=2, Hk=1, K=5, V=7, g="key", gk=True, gv=True,
      g_gamma="seq", initial_state=True, seqlens=(70, 1, 0, 40), packed=True),
    C("varlen-everything-rev", H=2, Hk=1, K=5, V=7, g="key", gk=True, gv=True,
      g_gamma="seq", initial_state=True, reverse=True, seqlens=(40, 0, 1, 70), packed=True),
]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_split_matches_oracle_and_unsplit(case):
    check(case)


def test_wide_tiles_several_v_blocks():
    """K = 100 (a padded block of 128; bf16: fp32 splits K past 64 instead), V = 80: three
    V blocks in the local pass, two combine blocks of 32 (the last one partial)."""
    check(C("blocks", T=80, H=1, Hk=1, K=100, V=80, g="head", gv=True, initial_state=True,
            gate_scale=0.02), "bfloat16", splits=(3,))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision(dtype):
    check(C("low", T=100, H=2, Hk=1, K=16, V=24, g="key", gv=True, initial_state=True,
            gate_scale=0.02), dtype, splits=(3,))


def test_strong_gates():
    """Log gates of -1e4 x logsigmoid: every segment's summed decays far below the
    reset floor, so each segment's incoming state is e^(floor) x ... = 0 exactly."""
    check(C("strong", T=100, H=1, Hk=1, K=8, V=8, g="key", gk=True, gv=True,
            g_gamma="head", initial_state=True, gate_scale=1e4), splits=(2, 3))


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_minus_inf_gates(reverse):
    """Full resets (log 0) at single steps of g and gv, and a whole step of -inf: the
    segments' summed log decays stay finite (floored), their exp 0, never NaN."""
    case = C("inf", T=100, H=2, Hk=2, K=8, V=8, g="key", gv=True, initial_state=True,
             reverse=reverse)
    arrays = backends.prepared(case, "float32", 0)
    arrays["g"][0, 10, 0, :4] = -np.inf
    arrays["gv"][0, 45, 1] = -np.inf
    arrays["g"][0, 80] = -np.inf
    check(case, arrays=arrays, splits=(2, 3))


def test_gradients_after_a_split_forward():
    """The backward (the family's, from the inputs) after a split forward: every
    gradient against the oracle's."""
    case = C("bwd", H=2, Hk=1, K=5, V=7, g="key", gv=True, g_gamma="seq",
             initial_state=True, reverse=True, seqlens=(70, 1, 0, 40), packed=True)
    arrays = backends.prepared(case, "float32", 0)
    got, kernels = run(case, arrays, "float32", 3, backward=True)
    assert len(kernels) == 3
    assert_close(errors(got, ORACLE.run(case, arrays, "float32"), case.gate_grad_floor),
                 "float32")


def _grid(shape, gates="key", sms=None, knobs=None, device="8.0 Fake GPU"):
    plan = report.report_plan(shape, "bf16", gates)
    with tuning.on_device(device, sms), tuning.overriding({SITE: knobs or {}}):
        return [(ln.kernel.__name__, ln.grid[0]) for ln in fused_chunk.forward_launches(plan)]


def _rounds(ns, programs, slots):
    """The rule's cost, written out: rounds of slots per segment walk (the local pass's
    programs at half an output program's)."""
    return (np.ceil(ns * programs / slots) + np.ceil((ns - 1) * programs / slots) / 2) / ns


def test_rule_search_stops_early_with_the_argmin():
    """split.best_segments' early stop returns the exhaustive argmin of the rule's cost
    (`_rounds` in exact fractions; the fewest segments on ties) over programs, slots and
    the longest sequences' limits."""
    def rounds(ns, programs, slots):
        return (math.ceil(Fraction(ns * programs, slots))
                + math.ceil(Fraction((ns - 1) * programs, slots)) / Fraction(2)) / ns

    for programs in (1, 2, 3, 4, 7, 8, 16, 33, 64, 100, 128, 131, 132, 133, 256, 1000):
        for slots in (1, 8, 108, 132, 264, 528):
            for most in (1, 2, 16, 128, 512):
                want = min(range(1, most + 1),
                           key=lambda ns: (rounds(ns, programs, slots), ns))
                assert split.best_segments(programs, slots, most) == want, (programs, slots,
                                                                           most)


def test_rule_fills_the_device():
    """The segments with the fewest rounds of SM slots per segment walk, the fewest on
    ties (the cost written out in `_rounds`, its argmin worked by hand for six cases):
    none where a wave is full (8 x 16 heads x 2 V blocks = 256 programs on sm_80 tiles;
    128 on sm_90's, where a second segment would only fill 4 more of 132 SMs), 33 for
    one sequence of 4 heads (8 x 33 = 264 programs in two rounds on sm_80 tiles, 4 x 33
    = 132 in one on sm_90's; 66 with waves = 4); 1 with no SM count (the CPU, the
    interpreter) and with waves = 0; segments of at least min_chunks chunks."""
    fwd, local, comb = "fused_chunk_fwd_kernel", "fused_chunk_fwd_kernel", \
        "fused_chunk_combine_kernel"
    for programs, slots, most in ((8, 132, 128), (4, 132, 128), (8, 264, 128), (256, 132, 16),
                                  (128, 132, 16), (100, 132, 16)):
        best = min(range(1, most + 1), key=lambda ns: (_rounds(ns, programs, slots), ns))
        assert best == {(8, 132): 33, (4, 132): 33, (8, 264): 33, (256, 132): 1,
                        (128, 132): 1, (100, 132): 1}[programs, slots]
    assert _grid((8, 4096, 16, 128, 128), sms=132) == [(fwd, 256)]
    assert _grid((8, 4096, 16, 128, 128), sms=132, device="9.0 Fake GPU") == [(fwd, 128)]
    assert _grid((1, 32768, 4, 128, 128)) == [(fwd, 8)]  # SM count unknown
    assert _grid((1, 32768, 4, 128, 128), sms=132) == [(local, 8 * 32), (comb, 4 * 4),
                                                       (fwd, 8 * 33)]
    assert _grid((1, 32768, 4, 128, 128), sms=132, device="9.0 Fake GPU") == [
        (local, 4 * 32), (comb, 4 * 4), (fwd, 4 * 33)]
    assert _grid((1, 32768, 4, 128, 128), sms=132, knobs=dict(waves=4))[-1] == (fwd, 8 * 66)
    assert _grid((1, 32768, 4, 128, 128), sms=132, knobs=dict(waves=0)) == [(fwd, 8)]
    # 2048 chunks (sm_80's 16 tokens with per-key decays past 64 keys), segments of >= 256:
    # at most 8
    assert _grid((1, 32768, 4, 128, 128), sms=132,
                 knobs=dict(min_chunks=256))[-1] == (fwd, 8 * 8)
    # a forced factor wins over the rule, on the CPU too
    assert _grid((8, 4096, 16, 128, 128), knobs=dict(segments=4), device=None)[-1] == \
        (fwd, 256 * 4)
    with pytest.raises(ValueError, match="fused_chunk/split segments must be an int >= 0"):
        _grid((8, 4096, 16, 128, 128), knobs=dict(segments=-1))
    with pytest.raises(ValueError, match="fused_chunk/split has no knob"):
        _grid((8, 4096, 16, 128, 128), knobs=dict(factor=2))


def test_sweep_tries_split_factors():
    """The GPU kit's sweep candidates for fused_chunk: the rule's defaults first, then the
    other waves (bridge.tuning.candidates over fused_chunk.SITES)."""
    plan = report.report_plan((8, 4096, 16, 128, 128), "bf16", "key")
    cands = [k for f, s, k in tuning.candidates(plan, "fused_chunk") if (f, s) == SITE]
    assert [k["waves"] for k in cands] == [1, 0, 2, 4]
    assert all(k["segments"] == 0 for k in cands)


def test_sweep_times_the_whole_split_forward():
    """The kit's sweep step on a split candidate (more launches than the defaults): the
    whole forward list is timed, each candidate's own (on the CPU, a faked SM count)."""
    from parity.gpu import plan as kit, sweep

    p = sweep.call_plan(kit.DRY, "key")  # (1, 16, 1, 16, 16) fp32: one chunk
    default = next(c for c in tuning.candidates(p, "fused_chunk") if c[:2] == SITE)
    forced = (*SITE, dict(default[2], segments=2))
    assert sweep.affected(p, "fused_chunk", "split", [default]) == []
    which = sweep.affected(p, "fused_chunk", "split", [default, forced])
    assert which == [(0, -1)]
    times = [sweep.measure(kit.DRY, "key", "fused_chunk", p, c, which, 1)
             for c in (default, forced)]
    assert all(len(t) == 1 and t[0] > 0 for t in times), times


@pytest.mark.parametrize("backend", ["torch-triton-fused-chunk", "jax-triton-fused-chunk"])
def test_public_call_with_a_split(backend, monkeypatch):
    """The split forward through the public torch_side / jax_side functions (their
    parity backends, each framework's executor of the three launches): o, final state
    and every gradient against the oracle."""
    from bridge.kernels import fused_chunk_split

    b = {x.name: x for x in backends.all_backends()}[backend]
    if b.unavailable():
        pytest.skip(b.unavailable())
    made = []  # the split's launch lists built (not a trace cached from another test)
    combine = fused_chunk_split.combine_launch
    monkeypatch.setattr(fused_chunk_split, "combine_launch",
                        lambda *a: made.append(a[1]) or combine(*a))
    case = C("public-split", H=2, Hk=1, K=8, V=8, seqlens=(70, 0, 7), g="key", gv=True,
             g_gamma="seq", initial_state=True, packed=True, gate_scale=0.02)
    arrays = backends.prepared(case, "float32", 0)
    with tuning.overriding({SITE: dict(segments=3)}):
        got = b.run(case, arrays, "float32")
    assert made and set(made) == {3}
    assert_close(errors(got, ORACLE.run(case, arrays, "float32")), "float32")


def test_local_pass_in_k_blocks(monkeypatch):
    """The local pass takes K in blocks (K = 40 in blocks of 16: three, the last
    partial), each block its own keys' state rows and summed decays."""
    from bridge.kernels import fused_chunk_split

    monkeypatch.setattr(fused_chunk_split, "LOCAL_BK", 16)
    check(C("k-blocks", T=100, H=1, Hk=1, K=40, V=8, g="key", gk=True, gv=True,
            initial_state=True, gate_scale=0.02), splits=(3,))
