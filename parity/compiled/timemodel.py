"""A time model per launch, from what the AOT report already has (no GPU).

    t = launch_time(rec, HARDWARE["H200"])   # rec: a launch record of parity.compiled's report
    t["total"], t["binds"]                 # seconds, and which term sets them

Per launch, each a time in seconds on one GPU of `HARDWARE`:

    hbm    = bytes / HBM bandwidth
    tensor = tensor-core FLOPs (the SASS's HMMA / HGMMA, `mma_flops`) / tensor peak
    mufu   = MUFU.EX2 warp-instructions x 32 lanes / (16 a clock x SMs x clock)
    issue  = warp-instructions / (4 a clock x SMs x clock)
    chain  = waves x one program's dependent chain (cycles) / clock,
             waves = ceil(programs / (SMs x CTAs per SM))

and total = max(hbm, tensor, mufu, issue, chain) + a fixed cost per launch. The
chain of a program is what one warp needs with the SM to itself: `chain_cycles`
walks a code region's SASS in order (one issue a cycle; an instruction waits for
its source registers; the latencies of `LATENCY`; cp.async groups, wgmma groups
and the MUFU pipe's occupancy tracked), and a program's chain is its code
outside loops once plus each loop body's steady-state chain x the body's runs
per program (parity.compiled.sass). The throughput terms assume the work spreads over
every SM; the chain assumes nothing else slows that warp down. Every constant is
a datasheet figure or a published microbenchmark's, none fitted to a timing.
"""

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    clock_hz: float        # SM clock the datasheet's tensor peak implies (see HARDWARE)
    hbm_bytes_per_s: float
    tensor_flops: float    # dense bf16 / fp16
    mufu_per_clock: int    # ex2 lanes per clock per SM
    issue_per_clock: int   # warp-instructions per clock per SM (one per scheduler)


# NVIDIA H100 / H200 datasheets: SXM H100 80GB 3.35 TB/s HBM3, H200 141GB 4.8 TB/s HBM3e, both
# 989 TFLOP/s dense bf16 on the same GH100 chip with 132 SMs (Hopper whitepaper). 989.4e12 =
# 132 SMs x 4096 FLOP a clock (4 tensor cores x 512 FMA) x 1.83 GHz: that clock is used for
# every per-clock rate. CUDA C++ Programming Guide, arithmetic instruction throughput (cc 9.0):
# 16 exp2 a clock per SM; 4 warp schedulers a SM, one warp-instruction each a clock.
HARDWARE = {
    "H100": Gpu("H100 SXM", 132, 1.83e9, 3.35e12, 989.4e12, 16, 4),
    "H200": Gpu("H200 SXM", 132, 1.83e9, 4.8e12, 989.4e12, 16, 4),
}
TENSOR_FLOPS_PER_CLOCK = 4096   # per SM, dense bf16 (above)

# Dependent-issue latencies in cycles (Hopper; Luo et al. 2024, "Benchmarking and Dissecting
# the Nvidia Hopper GPU Architecture", arXiv 2402.13499, and Jia et al.'s Volta/Turing
# dissections for the classes they share): an instruction's result is ready this long after
# it issues. gmem: a load that misses to HBM; smem also for constant and local (spill) loads,
# which hit L1; hmma: one m16n8k16; hgmma: the fixed part of a wgmma (plus its FLOPs at
# TENSOR_FLOPS_PER_CLOCK, which back-to-back wgmmas do not overlap); bar: a bar.sync all warps
# reach together.
LATENCY = dict(alu=4, conv=6, mufu=18, shfl=24, smem=30, gmem=600, hmma=32, hgmma=32, bar=20,
               s2r=20)
MUFU_CLOCKS_PER_WARP = 8         # 32 lanes at 4 a clock on one of the SM's 4 partitions
LAUNCH_S = 3e-6                  # a dependent launch on one stream: start and drain

TERMS = ("hbm", "tensor", "mufu", "issue", "chain")

_NO_DEST = re.compile(r"^(ST|RED|BAR|BRA|EXIT|RET|WARPGROUP|DEPBAR|LDGDEPBAR|LDGSTS|MEMBAR|"
                      r"FENCE|NOP|WARPSYNC|CALL|UTMA|SYNCS|ARRIVES|CCTL|ERRBAR|BSYNC|BSSY|YIELD)")
_REG = re.compile(r"\b(U?R\d+|U?P\d)(\.64)?\b")
_HGMMA = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\.(F32|F16)")
_HMMA = re.compile(r"HMMA\.168(\d+)")  # m16 n8 k16 / k8


def mma_flops(op: str) -> int:
    """FLOPs of one tensor-core warp-instruction: an HMMA.MNK (one warp's m x n x k)
    or a warp's share of an HGMMA.MxNxK (a warpgroup's, split over its 4 warps)."""
    m = _HGMMA.match(op)
    if m:
        return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 4
    m = _HMMA.match(op)
    return 2 * 16 * 8 * int(m.group(1)) if m else 0


def _width(op: str) -> int:
    """Registers a destination spans."""
    m = _HGMMA.match(op)
    if m:  # M x N accumulators over a warpgroup's 128 threads, fp32 one a register
        return int(m.group(1)) * int(m.group(2)) // (128 if m.group(4) == "F32" else 256)
    if op.startswith("HMMA"):
        return 4 if ".F32" in op else 2
    for tag, w in ((".128", 4), (".64", 2), (".WIDE", 2), (".M88.4", 4), (".M88.2", 2)):
        if tag in op:
            return w
    return 1


def _regs(tok: str, wide: bool, n: int = 1) -> list:
    base = re.match(r"(U?R|U?P)(\d+)", tok)
    if tok in ("RZ", "PT", "URZ", "UPT") or not base:
        return []
    k = int(base.group(2))
    return [f"{base.group(1)}{k + i}" for i in range(2 if wide and n == 1 else n)]


def operands(text: str) -> tuple:
    """(opcode, destination registers, source registers) of one SASS line."""
    guard = []
    if text.startswith("@"):
        g, text = text.split(None, 1)
        guard = [g.lstrip("@!")]
    parts = text.split(None, 1)
    op, rest = parts[0], parts[1] if len(parts) > 1 else ""
    toks = [t.strip() for t in rest.split(",")] if rest else []
    dests = []
    if toks[:1] == ["PT"]:  # a discarded predicate result (SHFL's lane check) precedes the data
        toks = toks[1:]
    if toks and not _NO_DEST.match(op) and re.match(r"^U?[RP]\d", toks[0]):
        dests = _regs(toks[0].split(".")[0], False, _width(op))
        toks = toks[1:]
    srcs = [r for r in guard if r not in ("PT", "UPT")]
    mma = op.startswith(("HMMA", "HGMMA"))
    for t in toks:
        for name, wide in _REG.findall(t):
            # an MMA's C operand spans the accumulators; its A operand a fragment of 4
            n = len(dests) if mma and dests and name == dests[0] else 4 if mma else 1
            srcs += _regs(name, bool(wide), n)
    return op, dests, srcs


def _kind(op: str) -> str:
    for prefix, kind in (("HGMMA", "hgmma"), ("HMMA", "hmma"), ("MUFU", "mufu"),
                         ("SHFL", "shfl"), ("LDS", "smem"), ("LDSM", "smem"), ("LDC", "smem"),
                         ("LDL", "smem"),
                         ("LDG", "gmem"), ("LD.", "gmem"), ("ATOM", "gmem"), ("S2R", "s2r"),
                         ("S2UR", "s2r"), ("F2F", "conv"), ("I2F", "conv"), ("F2I", "conv"),
                         ("BAR.SYNC", "bar")):
        if op.startswith(prefix):
            return kind
    return "alu"


def chain_cycles(texts, passes: int = 1, latency: dict = None) -> float:
    """Cycles one warp needs for `passes` runs of the SASS lines `texts` in order,
    the SM to itself: each instruction issues a cycle after the previous one or
    when its sources are ready, whichever is later. With passes=2 the second run's
    cycles (a loop body's steady state: what one iteration leaves in flight counts)."""
    lat = dict(LATENCY, **(latency or {}))
    ready, t, mufu_free = {}, 0.0, 0.0
    cp_pending, cp_groups, wg_done = 0.0, [], 0.0
    ends = []
    for _ in range(passes):
        for text in texts:
            op, dests, srcs = operands(text)
            kind = _kind(op)
            if kind == "hgmma":  # the accumulators chain inside the tensor cores (wg_done)
                srcs = [r for r in srcs if r not in dests]
            start = max([t + 1] + [ready.get(r, 0.0) for r in srcs])
            if op.startswith("DEPBAR"):  # wait until at most N cp.async groups are in flight
                m = re.search(r"0x([0-9a-f]+)|,\s*(\d+)\s*$", text)
                n = int(m.group(1), 16) if m and m.group(1) else int(m.group(2)) if m else 0
                if len(cp_groups) > n:
                    start = max(start, cp_groups[len(cp_groups) - 1 - n])
            elif op.startswith("WARPGROUP.DEPBAR"):
                start = max(start, wg_done)
            elif kind == "mufu":
                start = max(start, mufu_free)
                mufu_free = start + MUFU_CLOCKS_PER_WARP
            elif kind == "bar":
                start += lat["bar"]
            t = start
            done = t + lat[kind]
            if kind == "hgmma":
                # a pipeline: its fixed latency overlaps the previous wgmma's, its FLOPs don't
                busy = 4 * mma_flops(op) / TENSOR_FLOPS_PER_CLOCK
                done = max(t + lat["hgmma"] + busy, wg_done + busy)
                wg_done = done
            if op.startswith("LDGSTS"):
                cp_pending = max(cp_pending, t + lat["gmem"])
            elif op.startswith("LDGDEPBAR"):
                cp_groups.append(max(cp_pending, t))
                cp_pending = 0.0
            for r in dests:
                ready[r] = done
        ends.append(t)
    return ends[-1] - (ends[-2] if passes > 1 else 0.0)


# ---------------------------------------------------------------- per launch

def waves(programs: int, ctas_per_sm: int, gpu: Gpu) -> int:
    """Rounds of programs the GPU runs: ceil(programs / (SMs x CTAs per SM))."""
    return math.ceil(programs / (gpu.sms * max(int(ctas_per_sm), 1)))


# what `time` reads of a record besides dynamic and ctas_per_sm (parity.compiled.fla keeps
# them for every autotune config)
FIELDS = ("programs", "bytes", "mma_flops", "chain", "dynamic_classes")


def launch_time(rec: dict, gpu: Gpu) -> dict:
    """Each term of `TERMS` (seconds) for one launch record, "waves", "total" =
    the largest term + LAUNCH_S, and "binds" = which term is the largest. The
    record's fields: bytes, mma_flops, dynamic, dynamic_classes["MUFU.EX2"],
    programs, ctas_per_sm, chain (cycles per program). A record with "configs"
    (an autotuned launch) gets its fastest config's, as the autotuner picks
    ("config" names it)."""
    configs = [c for c in rec.get("configs") or () if "chain" in c]
    if configs:
        return min((dict(_time(c, gpu), config=c["config"]) for c in configs),
                   key=lambda t: t["total"])
    return _time(rec, gpu)


def _time(rec: dict, gpu: Gpu) -> dict:
    per_clock = gpu.sms * gpu.clock_hz
    w = waves(rec["programs"], rec["ctas_per_sm"], gpu)
    t = dict(hbm=rec.get("bytes", 0) / gpu.hbm_bytes_per_s,
             tensor=rec.get("mma_flops", 0) / gpu.tensor_flops,
             mufu=rec["dynamic_classes"].get("MUFU.EX2", 0) * 32 / (gpu.mufu_per_clock * per_clock),
             issue=rec["dynamic"] / (gpu.issue_per_clock * per_clock),
             chain=w * rec.get("chain", 0) / gpu.clock_hz)
    binds = max(TERMS, key=lambda k: t[k])
    return dict(t, waves=w, total=t[binds] + LAUNCH_S, binds=binds, programs=rec["programs"],
                ctas_per_sm=rec["ctas_per_sm"], chain_cycles=rec.get("chain", 0))


def totals(recs, gpu: Gpu) -> dict:
    """{"fwd", "bwd", "fwd+bwd": seconds} of launch records (their "phase"): fwd the forward
    no backward follows ("fwd-infer" where the records have one, else "fwd"), fwd+bwd the
    forward as autograd runs it ("fwd", which writes what the backward reuses) and "bwd"."""
    t = {p: sum(launch_time(r, gpu)["total"] for r in recs if r["phase"] == p)
         for p in ("fwd", "fwd-infer", "bwd")}
    infer = any(r["phase"] == "fwd-infer" for r in recs)
    return {"fwd": t["fwd-infer"] if infer else t["fwd"], "bwd": t["bwd"],
            "fwd+bwd": t["fwd"] + t["bwd"]}


def modelled(recs) -> list:
    """The records the model can read: sm_90 launches with a SASS section."""
    return [r for r in recs if r.get("target", "sm_90") == "sm_90" and "chain" in r]


# ---------------------------------------------------------------- tables

TEXT = ("Time model (parity/compiled/timemodel.py): per launch hbm = bytes / HBM bandwidth, "
        "tensor = "
        "HMMA/HGMMA FLOPs / tensor peak, mufu = ex2 lanes / (16 a clock x SMs), issue = "
        "warp-instructions / (4 a clock x SMs), chain = waves x one program's dependent SASS "
        "chain; a launch takes the largest + {:.0f} us. H100 SXM: 3.35 TB/s; H200: 4.8 TB/s; "
        "both 132 SMs at 1.83 GHz, 989.4 TFLOP/s bf16; latencies (cycles) {}.").format(
            LAUNCH_S * 1e6, ", ".join(f"{k} {v}" for k, v in LATENCY.items()))


def launch_markdown(recs, gpu: Gpu = HARDWARE["H200"], other: Gpu = HARDWARE["H100"]) -> str:
    """One row per launch: its terms on `gpu` (us), the binding one, and its total
    on `gpu` and `other`."""
    lines = [f"| phase | kernel | programs | CTAs/SM | waves | chain cycles per program | "
             f"hbm us | tensor us | mufu us | issue us | chain us | binds | {gpu.name} us | "
             f"{other.name} us |", "|---" * 14 + "|"]
    for r in modelled(recs):
        t, o = launch_time(r, gpu), launch_time(r, other)
        name = f"`{r['kernel']}`" + (f" [{t['config']}]" if t.get("config") else "")
        lines.append(f"| {r['phase']} | {name} | {t['programs']} | {t['ctas_per_sm']} | "
                     f"{t['waves']} | {t['chain_cycles']:.0f} | "
                     + " | ".join(f"{t[k] * 1e6:.1f}" for k in TERMS)
                     + f" | {t['binds']} | {t['total'] * 1e6:.1f} | {o['total'] * 1e6:.1f} |")
    for g in (gpu, other):
        s = totals(modelled(recs), g)
        lines.append(f"\n{g.name}: fwd {s['fwd'] * 1e3:.3f} ms, "
                     f"fwd+bwd {s['fwd+bwd'] * 1e3:.3f} ms.")
    return "\n".join(lines)


def _share(recs, gpu: Gpu, phases) -> str:
    """The terms that bind, with their share of the total, over `phases`."""
    got = {}
    for r in recs:
        if r["phase"] in phases:
            t = launch_time(r, gpu)
            got[t["binds"]] = got.get(t["binds"], 0.0) + t["total"]
    whole = sum(got.values()) or 1.0
    return ", ".join(f"{k} {v / whole:.0%}" for k, v in sorted(got.items(), key=lambda kv: -kv[1]))


def compare_markdown(families: dict, measured: dict = None) -> str:
    """families: {label: (T, launch records)}; measured: {(family, T): (fwd ms, fwd+bwd
    ms)} on an H200, family = the label's first word. One row per family, T and GPU:
    model fwd / fwd+bwd, error against the measurement, the binding terms' shares."""
    measured = measured or {}
    lines = ["| family | T | GPU | model fwd ms | measured fwd ms | error | model fwd+bwd ms | "
             "measured fwd+bwd ms | error | binds (share of fwd+bwd) |", "|---" * 10 + "|"]
    for label, (T, recs) in families.items():
        recs = modelled(recs)
        for name in ("H200", "H100"):
            gpu = HARDWARE[name]
            s = totals(recs, gpu)
            m = measured.get((label.split(" ")[0], T)) if name == "H200" else None
            cells = []
            for key, i in (("fwd", 0), ("fwd+bwd", 1)):
                cells.append(f"{s[key] * 1e3:.3f}")
                if m:
                    cells += [f"{m[i]:.3f}", f"{(s[key] * 1e3 - m[i]) / m[i]:+.1%}"]
                else:
                    cells += ["-", "-"]
            lines.append(f"| {label.split(' ')[0]} | {T} | {gpu.name} | " + " | ".join(cells)
                         + f" | {_share(recs, gpu, ('fwd', 'bwd'))} |")
    return "\n".join(lines)


# H200 timings the model is checked against (BENCHMARKS.md "## GPU", bf16, (B,H,K,V) =
# (8,16,128,128), GLA key gate): {(family, T): (fwd ms, fwd+bwd ms)}.
MEASURED_H200 = {("chunk", 4096): (1.558, 6.384), ("fla", 4096): (1.337, 6.018),
                 ("chunk", 8192): (3.055, 12.721), ("fla", 8192): (2.606, 11.907)}
