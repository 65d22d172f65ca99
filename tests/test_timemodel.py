"""parity.compiled.timemodel: each term against a closed form worked by hand, the waves, the
binding term, and the dependent chain of hand-written SASS."""

import math

import pytest

from parity.compiled import sass, timemodel
from parity.compiled.timemodel import HARDWARE, LATENCY, LAUNCH_S, chain_cycles, mma_flops, operands

H200, H100 = HARDWARE["H200"], HARDWARE["H100"]
CLOCK = 1.83e9          # 989.4e12 / (132 SMs x 4096 FLOP a clock)


def rec(**kw):
    r = dict(phase="fwd", kernel="k", programs=1, ctas_per_sm=1, bytes=0, mma_flops=0,
             dynamic=0, dynamic_classes={"MUFU.EX2": 0}, chain=0)
    r.update(kw)
    return r


def test_hardware_constants_match_the_datasheets():
    for gpu in (H100, H200):
        assert gpu.sms == 132 and gpu.tensor_flops == 989.4e12
        # the datasheet's tensor peak is 132 SMs x 4096 FLOP a clock at the model's clock
        assert gpu.sms * 4096 * gpu.clock_hz == pytest.approx(989.4e12, rel=1e-3)
    assert (H100.hbm_bytes_per_s, H200.hbm_bytes_per_s) == (3.35e12, 4.8e12)


def test_each_term_against_its_closed_form():
    t = timemodel.launch_time(rec(bytes=4.8e9), H200)
    assert t["hbm"] == pytest.approx(1e-3)
    assert timemodel.launch_time(rec(bytes=3.35e9), H100)["hbm"] == pytest.approx(1e-3)
    assert timemodel.launch_time(rec(mma_flops=989.4e9), H200)["tensor"] == pytest.approx(1e-3)
    # 132 SMs x 16 lanes a clock: 2112 x 1.83e9 / 32 warp-instructions a second
    n = 2112 * CLOCK / 32 * 1e-3
    assert timemodel.launch_time(rec(dynamic_classes={"MUFU.EX2": n}), H200)["mufu"] == \
        pytest.approx(1e-3)
    # 132 SMs x 4 schedulers
    t = timemodel.launch_time(rec(dynamic=528 * CLOCK * 1e-3), H200)
    assert t["issue"] == pytest.approx(1e-3)
    # 8192 programs, 2 a SM: ceil(8192 / 264) = 32 waves of 1830 cycles = 32 us
    t = timemodel.launch_time(rec(programs=8192, ctas_per_sm=2, chain=1830), H200)
    assert t["waves"] == 32 and t["chain"] == pytest.approx(32e-6)


@pytest.mark.parametrize("programs, ctas, want", [(1, 1, 1), (132, 1, 1), (133, 1, 2),
                                                  (264, 2, 1), (265, 2, 2), (16384, 4, 32),
                                                  (512, 5, 1)])
def test_waves(programs, ctas, want):
    assert timemodel.waves(programs, ctas, H200) == want == math.ceil(programs / (132 * ctas))


def test_the_largest_term_binds_and_sets_the_total():
    r = rec(bytes=4.8e9, mma_flops=2 * 989.4e9, dynamic=528 * CLOCK * 0.5e-3)
    t = timemodel.launch_time(r, H200)
    assert t["binds"] == "tensor" and t["total"] == pytest.approx(2e-3 + LAUNCH_S)
    # H100's HBM is slower: 4.8e9 / 3.35e12 = 1.43 ms, still under the tensor term
    assert timemodel.launch_time(r, H100)["binds"] == "tensor"
    t = timemodel.launch_time(rec(bytes=4.8e9, programs=1, chain=CLOCK * 3e-3), H200)
    assert t["binds"] == "chain" and t["total"] == pytest.approx(3e-3 + LAUNCH_S)
    recs = [rec(bytes=4.8e9), rec(phase="bwd", bytes=9.6e9)]
    s = timemodel.totals(recs, H200)
    assert s["fwd"] == pytest.approx(1e-3 + LAUNCH_S)
    assert s["fwd+bwd"] == pytest.approx(3e-3 + 2 * LAUNCH_S)


def test_mma_flops_of_the_opcodes():
    assert mma_flops("HGMMA.64x128x16.F32.BF16") == 2 * 64 * 128 * 16 // 4
    assert mma_flops("HGMMA.64x32x16.F32.BF16") == 2 * 64 * 32 * 16 // 4
    assert mma_flops("HMMA.16816.F32.BF16") == 2 * 16 * 8 * 16
    assert mma_flops("HMMA.1688.F32.TF32") == 2 * 16 * 8 * 8
    assert mma_flops("FFMA") == 0


def test_operands_of_sass_lines():
    op, d, s = operands("@P0 LDG.E.128 R56, desc[UR20][R112.64]")
    assert op == "LDG.E.128" and d == ["R56", "R57", "R58", "R59"]
    assert s == ["P0", "UR20", "R112", "R113"]
    op, d, s = operands("HGMMA.64x32x16.F32.BF16 R56, R96, gdesc[UR48].tnspB, RZ, !UPT")
    assert d == [f"R{56 + i}" for i in range(16)] and s[:4] == ["R96", "R97", "R98", "R99"]
    assert operands("STS.128 [R160+UR17], R112")[1] == []
    assert operands("ISETP.GE.AND P0, PT, R2, 0x3f, PT")[1:] == (["P0"], ["R2"])
    assert operands("SHFL.BFLY PT, R5, R4, 0x10, 0x1f")[1:] == (["R5"], ["R4"])


A = LATENCY["alu"]


@pytest.mark.parametrize("lines, passes, want", [
    # independent: one issue a cycle
    (["FADD R1, R2, R3", "FADD R4, R5, R6", "FADD R7, R8, R9"], 1, 3),
    # a dependent chain: 1, 1 + alu, 1 + 2 alu
    (["FADD R1, R2, R3", "FADD R4, R1, R1", "FADD R5, R4, R4"], 1, 1 + 2 * A),
    # load to use
    (["LDG.E R1, desc[UR4][R2.64]", "FADD R3, R1, R1"], 1, 1 + LATENCY["gmem"]),
    # a 128-bit load's last register, and a register after it
    (["LDG.E.128 R4, desc[UR4][R2.64]", "FADD R9, R7, R7"], 1, 1 + LATENCY["gmem"]),
    (["LDG.E.128 R4, desc[UR4][R2.64]", "FADD R9, R8, R8"], 1, 2),
    # two independent ex2 share one MUFU pipe: 8 cycles a warp apart
    (["MUFU.EX2 R1, R2", "MUFU.EX2 R3, R4"], 1, 1 + 8),
    # cp.async: the wait holds until the group lands
    (["LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", "LDGDEPBAR", "DEPBAR.LE SB0, 0x0",
      "LDS R3, [R1]"], 1, 1 + LATENCY["gmem"] + 1),
    # ... but not with one group allowed in flight
    (["LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", "LDGDEPBAR", "DEPBAR.LE SB0, 0x1",
      "LDS R3, [R1]"], 1, 4),
    # wgmma: its fixed latency and 64 x 128 x 16 x 2 FLOP at 4096 a clock
    (["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "WARPGROUP.DEPBAR.LE gsb0, 0x0"], 1,
     1 + LATENCY["hgmma"] + 64),
    # back to back: the second waits for the tensor cores, not for the first's latency
    (["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "HGMMA.64x128x16.F32.BF16 R24, "
      "gdesc[UR8], R24", "WARPGROUP.DEPBAR.LE gsb0, 0x0"], 1, 1 + LATENCY["hgmma"] + 2 * 64),
    (["BAR.SYNC.DEFER_BLOCKING 0x0"], 1, 1 + LATENCY["bar"]),
    # a shuffle's result, a spilled register's reload
    (["SHFL.BFLY PT, R5, R4, 0x10, 0x1f", "FADD R6, R5, R5"], 1, 1 + LATENCY["shfl"]),
    (["LDL R5, [R1+0x10]", "FADD R6, R5, R5"], 1, 1 + LATENCY["smem"]),
    # a guard predicate is a source
    (["ISETP.GE.AND P0, PT, R2, 0x3f, PT", "@P0 FADD R1, R2, R3"], 1, 1 + A),
    # a loop-carried dependency: the steady state costs its latency a run
    (["FADD R1, R1, R2"], 2, A),
    (["FADD R1, R1, R2", "FADD R3, R4, R5"], 2, A),
])
def test_chain_cycles_closed_forms(lines, passes, want):
    assert chain_cycles(lines, passes) == want


LISTING = """
        /*0000*/                   LDG.E R1, desc[UR4][R2.64] ;
        /*0010*/                   FADD R3, R1, R1 ;
.L_x_0:
        /*0020*/                   FADD R4, R4, R3 ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   EXIT ;
"""


def test_a_program_chain_is_its_straight_code_and_loop_bodies_times_their_runs():
    # no trip counts: the loop body counts once per program
    a = sass.analyze(b"", "", None, 4, sass=LISTING, programs=10)
    top = 1 + LATENCY["gmem"] + 1          # LDG; FADD waits for it; EXIT
    assert a.loops[0]["chain"] == A         # R4 carried from run to run
    assert a.chain == top + A
    assert a.mma_flops == 0


# The model's inputs at (B,T,H,K,V) = (8,4096,16,128,128) bf16, GLA key gate, sm_90, from
# `parity.compiled --report --arch 90` and `parity.compiled --fla` (fla: the config the model
# picks on an H200); recorded because building them takes minutes. A row: phase, kernel,
# programs, CTAs/SM, bytes, tensor FLOPs, warp-instructions, ex2 warp-instructions, chain
# cycles per program.
CHUNK = [
    ("fwd", "chunk_gate_kernel", 16384, 4, 406847488, 8589934592, 54460416, 2621440, 2565),
    ("fwd", "chunk_state_kernel", 512, 5, 553648128, 17179869184, 26368000, 0, 99114),
    ("fwd", "chunk_intra_kernel", 8192, 2, 335544320, 111669149696, 246743040, 12582912, 33250),
    ("fwd", "chunk_output_kernel", 8192, 2, 738197504, 34359738368, 45875200, 2097152, 6891),
    ("bwd", "chunk_gate_kernel", 16384, 4, 406847488, 8589934592, 54460416, 2621440, 2565),
    ("bwd", "chunk_state_kernel", 512, 5, 553648128, 17179869184, 26138624, 0, 98912),
    ("bwd", "chunk_gate_kernel", 16384, 4, 406847488, 8589934592, 55508992, 2621440, 2604),
    ("bwd", "chunk_state_kernel", 512, 5, 553648128, 17179869184, 27121664, 0, 99214),
    ("bwd", "chunk_dA_kernel", 8192, 3, 402653184, 8589934592, 27412752, 0, 2100),
    ("bwd", "chunk_dv_kernel", 8192, 2, 805306368, 34359738368, 47775744, 2097152, 6867),
    ("bwd", "chunk_dqk_kernel", 32768, 2, 1342177280, 412316860416, 583401472, 30408704, 33661),
]
FLA = [
    ("fwd", "chunk_local_cumsum_vector_kernel", 32768, 16, 402653184, 0, 43319296, 0, 1617),
    ("fwd", "chunk_fwd_kernel_h", 2048, 12, 813694976, 17179869184, 93378560, 8912896, 113055),
    ("fwd", "chunk_gla_fwd_A_kernel_intra_sub_inter",
     131072, 23, 671088640, 3221225472, 74055680, 6291456, 2572),
    ("fwd", "chunk_gla_fwd_A_kernel_intra_sub_intra",
     32768, 12, 671088640, 0, 217022464, 33554432, 30614),
    ("fwd", "chunk_gla_fwd_kernel_o", 16384, 5, 1073741824, 25769803776, 62095360, 4194304, 10633),
    ("bwd", "chunk_local_cumsum_vector_kernel", 32768, 16, 402653184, 0, 43319296, 0, 1617),
    ("bwd", "chunk_fwd_kernel_h", 2048, 11, 1073741824, 17179869184, 94418944, 8912896, 112278),
    ("bwd", "chunk_bwd_kernel_dh", 2048, 10, 1082130432, 17179869184, 109133824, 8912896, 143431),
    ("bwd", "chunk_gla_bwd_kernel_dv",
     16384, 2, 1342177280, 17179869184, 256966656, 4194304, 7890),
    ("bwd", "chunk_gla_bwd_kernel_dA", 8192, 8, 402653184, 5368709120, 13852672, 0, 4102),
    ("bwd", "chunk_gla_bwd_kernel_intra",
     65536, 6, 1207959552, 6442450944, 1067057152, 77594624, 28630),
    ("bwd", "chunk_gla_bwd_kernel_inter",
     32768, 4, 3221225472, 34359738368, 226951168, 4718592, 9943),
]


def recorded(rows):
    return [rec(phase=p, kernel=k, programs=n, ctas_per_sm=c, bytes=b, mma_flops=f, dynamic=d,
                dynamic_classes={"MUFU.EX2": e}, chain=ch) for p, k, n, c, b, f, d, e, ch in rows]


def test_recorded_totals_are_the_documented_ones():
    # BENCHMARKS.md, GPU readiness, "Time model": H200 ms
    for rows, fwd, both in ((CHUNK, 0.947, 3.919), (FLA, 0.983, 3.870)):
        s = timemodel.totals(recorded(rows), H200)
        assert (round(s["fwd"] * 1e3, 3), round(s["fwd+bwd"] * 1e3, 3)) == (fwd, both)
    binds = {r["kernel"]: timemodel.launch_time(r, H200)["binds"] for r in recorded(CHUNK)}
    assert binds["chunk_intra_kernel"] == binds["chunk_dqk_kernel"] == "chain"
    assert binds["chunk_gate_kernel"] == binds["chunk_output_kernel"] == "hbm"


def test_the_model_ranks_chunk_and_fla_forward_backward_as_the_h200_does():
    # the forward's ranking and the 25% reproduction are NOT met (BENCHMARKS.md, Time
    # model): targets are reported there, not held here
    ours, fla = (timemodel.totals(recorded(r), H200)["fwd+bwd"] for r in (CHUNK, FLA))
    measured = timemodel.MEASURED_H200
    assert (ours < fla) == (measured[("chunk", 4096)][1] < measured[("fla", 4096)][1])


def test_the_tables_carry_each_launch_and_the_totals():
    text = timemodel.launch_markdown([dict(r, target="sm_90") for r in recorded(CHUNK)])
    rows = [line for line in text.splitlines() if line.startswith("| fwd") or
            line.startswith("| bwd")]
    assert len(rows) == len(CHUNK)
    dqk = next(line for line in rows if "chunk_dqk_kernel" in line).split(" | ")
    assert dqk[11] == "chain" and dqk[4] == "125"          # ceil(32768 / 264) waves
    assert "H200 SXM: fwd 0.947 ms, fwd+bwd 3.919 ms." in text
    table = timemodel.compare_markdown({"chunk 4096": (4096, recorded(CHUNK))},
                                       timemodel.MEASURED_H200)
    assert "| chunk | 4096 | H200 SXM | 0.947 | 1.558 | -39.2% | 3.919 | 6.384 | -38.6% |" in table
