"""Step "varlen": packed variable-length sequences. 64 sequences of mixed lengths (log-uniform
in 16..4096, both ends present, fixed seed), H=16, K=V=128, bf16, offsets on the device:
ours chunked (torch launch) against fla's chunk_gla (given its host copy of the offsets,
`cu_seqlens_cpu`, its sync-free path), forward and forward+backward, and whether each
call synchronizes with the host (torch.cuda.set_sync_debug_mode("error") around a warmed
call). The dry run's stand-in for that check is the contract's offsets check on offsets
posing as CUDA (parity.gpu.standins)."""

import numpy as np

from parity.bench import gpu
from parity.compare import rel_err

from . import fla as fla_mod
from .rows import guarded
from .standins import failing

OURS = "ours chunk (torch)"


def workload(plan):
    """(seqlens, (q, k, v, g, do) as [1, total, H, *] leaves, cu on the device (int32),
    cu on the host (int64))."""
    import torch

    rng = np.random.default_rng(0)
    lo, hi = plan.varlen_lengths
    lens = np.exp(rng.uniform(np.log(lo), np.log(hi), plan.varlen_seqs)).astype(np.int64)
    lens[0], lens[-1] = lo, hi
    rng.shuffle(lens)
    H, K, V = plan.varlen_heads
    total = int(lens.sum())
    ins = gpu.gla_inputs((1, total, H, K, V), plan.device)
    ins = [x.requires_grad_(i < 4) for i, x in enumerate(ins)]
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]))
    return lens.tolist(), ins, cu.to(plan.device, torch.int32), cu


def names(plan) -> list:
    """The implementations this step times, in order."""
    fla = ("stand-in for " if plan.dry else "") + "fla chunk_gla"
    fails = ["stand-in that fails"] if "failing-impl" in plan.faults else []
    return fails + [OURS, fla, fla + " without cu_seqlens_cpu"]


def expected(plan) -> list:
    return [dict(impl=n, mode=m) for n in names(plan) for m in ("fwd", "fwdbwd")]


def _ops(plan, fns, cu, cu_host, why=None):
    """{name: fn, or why it is absent} in `names` order."""
    import torch_side

    ours = lambda q, k, v, g: torch_side.recurrent_gla(  # noqa: E731
        q, k, v, g, cu_seqlens=cu, platform="triton", mode="chunk")[0]
    *fails, _, name, _ = names(plan)
    out = {n: failing for n in fails}
    out[OURS] = ours
    if fns is None:
        out[name] = out[name + " without cu_seqlens_cpu"] = why
    else:
        fla = fns["chunk_gla"]
        out[name] = lambda q, k, v, g: fla(q, k, v, g, cu_seqlens=cu.long(), cu_seqlens_cpu=cu_host,
                                           output_final_state=True)[0]
        out[name + " without cu_seqlens_cpu"] = lambda q, k, v, g: fla(
            q, k, v, g, cu_seqlens=cu.long(), output_final_state=True)[0]
    return out


def _call(op, ins, mode):
    import torch

    q, k, v, g, do = ins
    if mode == "fwd":
        with torch.no_grad():
            return op(q, k, v, g)
    return torch.autograd.grad(op(q, k, v, g), (q, k, v, g), do)


def ours_calls(plan):
    def thunk():
        _, ins, cu, cu_host = workload(plan)
        for mode in ("fwd", "fwdbwd"):
            _call(_ops(plan, None, cu, cu_host)[OURS], ins, mode)
    return [("varlen ours chunk", thunk)]


def fla_calls(plan):
    fns, _ = fla_mod.ops(plan)
    if fns is None:
        return []

    def thunk():
        _, ins, cu, cu_host = workload(plan)
        for name, op in _ops(plan, fns, cu, cu_host).items():
            if "fla" in name:
                for mode in ("fwd", "fwdbwd"):
                    _call(op, ins, mode)
    return [("varlen chunk_gla", thunk)]


DRY_SYNC = "not checked on the CPU (stand-in below)"


def host_sync(plan, call):
    """None when a warmed call makes no host sync, else the first line of what did."""
    if plan.dry:
        return DRY_SYNC
    import torch

    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        return None
    except RuntimeError as e:
        return (str(e).splitlines() or ["RuntimeError"])[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def run(emit, deadline, *, plan, configs=None):
    """Each implementation and mode, guarded (parity/gpu/rows.py)."""
    fns, why, _ = fla_mod.prepare(plan, configs)
    lens, ins, cu, cu_host = workload(plan)
    total = int(cu_host[-1])
    ops = _ops(plan, fns, cu, cu_host, why)
    try:
        want = _call(ops[OURS], ins, "fwd").float().cpu().numpy()
    except Exception:  # ours' own rows report it
        want = None
    for name, op in ops.items():
        for mode in ("fwd", "fwdbwd"):
            row = dict(impl=name, mode=mode, tokens=total)
            if isinstance(op, str):
                emit("row", **row, status="absent", error=op)
                continue

            def measure(op=op, mode=mode):
                got = {}
                if mode == "fwd" and want is not None:
                    got["vs_ours"] = rel_err(_call(op, ins, "fwd").float().cpu().numpy(), want)
                got["host_sync"] = host_sync(plan, lambda: _call(op, ins, mode))
                got["ms"] = gpu.bench(lambda: _call(op, ins, mode), plan.device, plan.warmup_ms,
                                      plan.rep_ms, plan.host_calls)
                got["peak_bytes"] = gpu.peak_bytes(lambda: _call(op, ins, mode), plan.device)
                return got
            guarded(emit, "row", row, deadline, measure)
    result = {"seqlens": lens, "tokens": total, "heads": list(plan.varlen_heads), "fla": why}
    if plan.dry:  # the stand-in for the sync check: the offsets check, posing as CUDA
        from bridge import contract

        from .standins import HostRead, posing_on_cuda

        try:
            contract.check_offsets(posing_on_cuda(cu_host), total)
            result["stand_in_host_sync"] = None
        except HostRead as e:
            result["stand_in_host_sync"] = str(e)
    return result
