"""The steps of every public call around the launch, written once for both frameworks:

    prepare(...)  -> Call: the contract's Plan (`bridge.contract.check`), the platform
                     (`route`) and the kernel (`kernel_mode`, by `kernel_costs`)
    batched(...)  -> the inputs by name in the launchers' batched layout
    (the framework runs its platform on them)
    unbatched(...) -> o back in the caller's layout

Each framework keeps only what is its own: array conversion, autograd, devices.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from . import contract, tuning
from .contract import INPUTS, TOKENS, Plan

MODES = ("auto", "chunk", "fused_recurrent", "fused_chunk")
# the families that only the Triton platform runs ("chunk" is every platform's chunked form)
TRITON_ONLY = ("fused_recurrent", "fused_chunk")
# The largest head dims (K, V) each Triton family takes. chunk and
# fused_recurrent block K and V over loops and programs; up to 512 (fla's range) they are
# tested against the oracle and build without register spills (`python -m parity.compiled
# --report`). fused_chunk takes K up to 512 too (all of K in one block up to 256, past it
# K blocks over programs; its backward there is the chunk family's) and V up to 512 (past
# 128 its backward is the chunk family's). The torch,
# XLA and Pallas platforms take any head dims.
HEAD_DIMS = {"chunk": (512, 512), "fused_recurrent": (512, 512), "fused_chunk": (512, 512)}


class Call(NamedTuple):
    """What runs one call: `platform` ("triton", "torch", "xla", "pallas") and `kernel`,
    the Triton family ("chunk" / "fused_recurrent" / "fused_chunk") or, on the other platforms, the
    platform itself."""

    plan: Plan
    platform: str
    kernel: str


def prepare(inputs: dict, *, softmax_scale, reverse, cu_seqlens, platform, mode,
            platforms, fallback, gpu, tpu=False, memo=True) -> Call:
    """Check the arguments (`inputs`: the arrays of `contract.INPUTS` by name, absent ones
    None or left out; `memo` as `contract.check`), then resolve the platform and the
    kernel."""
    plan = contract.check(**inputs, softmax_scale=softmax_scale, reverse=reverse,
                          cu_seqlens=cu_seqlens, memo=memo)
    chosen = route(platform, mode, platforms, fallback, gpu=gpu, tpu=tpu)
    if chosen != "triton":
        return Call(plan, chosen, chosen)
    kernel = kernel_mode(mode, plan)
    why = refusal(plan, kernel)
    if why is None:
        return Call(plan, chosen, kernel)
    if platform == "auto" and mode not in TRITON_ONLY:
        # the framework's own chunked path takes any head dims
        return Call(plan, fallback, fallback)
    raise ValueError(why + (f" (mode='chunk' or 'auto' with platform='auto' or '{fallback}' "
                            f"runs any head dims)"))


def refusal(plan: Plan, kernel: str) -> str | None:
    """Why the Triton family `kernel` refuses the plan's head dims (`HEAD_DIMS`), as a
    ValueError message naming q or v; None when it takes them."""
    max_k, max_v = HEAD_DIMS[kernel]
    if plan.K > max_k:
        return f"q: mode='{kernel}' supports K <= {max_k}, got K={plan.K}"
    if plan.V > max_v:
        return f"v: mode='{kernel}' supports V <= {max_v}, got V={plan.V}"
    return None


def batched(plan: Plan, inputs: dict, new_axis: Callable) -> dict:
    """{name: input} for every name of `contract.INPUTS` (absent ones None), packed token
    inputs [total, H, *] given a leading axis by `new_axis` ([1, total, H, *])."""
    out = {}
    for name in INPUTS:
        x = inputs.get(name)
        out[name] = new_axis(x) if x is not None and plan.packed and name in TOKENS else x
    return out


def unbatched(plan: Plan, o):
    """The output in the caller's layout: [total, H, V] for packed inputs."""
    return o[0] if plan.packed else o


def route(platform, mode, platforms, fallback: str, gpu: bool, tpu: bool = False) -> str:
    """Validate `platform` and `mode` and resolve "auto": the Triton kernels on a
    GPU (or when a Triton-only family, `TRITON_ONLY`, is asked for), Pallas on a
    TPU, else `fallback`, the framework's own chunked path ("torch" or "xla").
    ejkernel's platform names outside `platforms` go through `foreign_platform`."""
    if platform not in platforms:
        platform = foreign_platform(platform, platforms, fallback, gpu)
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if platform == "auto":
        platform = ("triton" if gpu or mode in TRITON_ONLY
                    else "pallas" if tpu else fallback)
    if platform in (fallback, "pallas") and mode in TRITON_ONLY:
        raise ValueError(f"mode: '{mode}' is a Triton kernel; platform='{platform}' "
                         f"computes the chunked form (use mode='auto' or 'chunk')")
    return platform


# ejkernel's platform values (SPEC.md, "Named variants") that name no platform of ours
# in this framework, with what to use instead ("cuda" is mapped, see foreign_platform)
FOREIGN = {
    "tilelang": "ejkernel's TileLang kernels have no counterpart here: the GPU kernels "
                "are Triton ('triton', or 'cuda' for them on a CUDA GPU)",
    "cute": "ejkernel's CuTe kernels have no counterpart here: the GPU kernels are Triton "
            "('triton', or 'cuda' for them on a CUDA GPU)",
    "pallas": "Pallas kernels are the JAX side's (jax_side); PyTorch runs 'triton' or 'torch'",
    "xla": "'xla' is the JAX side's chunked path in framework ops; in PyTorch it is 'torch'",
    "torch": "'torch' is the PyTorch side's chunked path in framework ops; in JAX it is 'xla'",
}


def foreign_platform(platform, platforms, fallback: str, gpu: bool) -> str:
    """ejkernel's name "cuda" (its hand-written GPU kernels) means our Triton kernels
    compiled for the GPU, when the call has one; every other value outside `platforms`
    is a ValueError, which says what to use where the value is one of ejkernel's."""
    if platform == "cuda" and "triton" in platforms:
        if gpu:
            return "triton"
        where = ("q is not a CUDA tensor" if fallback == "torch"
                 else "JAX's default backend is not a GPU")
        raise ValueError(f"platform: 'cuda' means the Triton kernels compiled for a CUDA GPU, "
                         f"and {where}; use 'triton' (Triton's interpreter on CPU) or 'auto'")
    hint = FOREIGN.get(platform) if isinstance(platform, str) else None
    raise ValueError(f"platform: expected one of {platforms}, got {platform!r}"
                     + (f" ({hint})" if hint else ""))


# mode="auto" with the Triton kernels: a cost rule over the two things that set
# a small call's time on a GPU, launches and sequential steps per program.
# The fused recurrent kernel is one launch whose programs walk every token of a
# sequence (a rank-1 state update a step); the chunked forward is three
# launches whose only sequential part, the state pass, walks one 64-token chunk
# (a 64x64 matmul) a step. The constants are estimates (microseconds on an
# H100-class GPU), not fitted: the GPU runs (BENCHMARKS.md) timed large
# batches only, where the chunked forward won at every T >= 512 (1.02 vs 1.27 ms
# at (8,512,16,128,128) bf16), as these constants predict; short-sequence latency
# is unmeasured. They put the crossover near 80 tokens a sequence.
LAUNCH_US = 4.0        # launch and Triton dispatch overhead
FUSED_STEP_US = 0.12   # one token of the fused recurrence
CHUNK_STEP_US = 1.5    # one 64-token chunk of the state pass
CHUNK_LEN = 64
LAUNCHES = {"fused_recurrent": 1, "chunk": 3}


def sequence_length(plan: Plan) -> int:
    """T, or the mean length ceil(total / N) with cu_seqlens."""
    return plan.T if not plan.varlen else -(-plan.T // max(plan.N, 1))


def kernel_costs(plan: Plan) -> dict:
    """Estimated forward cost (us) of each Triton family for this call, at the
    `sequence_length` (the mean with cu_seqlens: the lengths may be traced, so the
    longest is not known)."""
    L = sequence_length(plan)
    return {"fused_recurrent": LAUNCHES["fused_recurrent"] * LAUNCH_US + L * FUSED_STEP_US,
            "chunk": LAUNCHES["chunk"] * LAUNCH_US + -(-L // CHUNK_LEN) * CHUNK_STEP_US}


# mode="auto" on a device whose table (bridge/tuning.py) holds a ranking: the site
# RANKING's entry for the call's kind, {"T": [lengths], "fastest": [families]}, the family
# the GPU kit timed fastest (forward+backward, batch x heads 8 x 16: parity/gpu/ranking.py)
# at each length
RANKING = ("auto", "mode")


def ranked(plan: Plan):
    """The family the device table ranks first for this call's length (`RANKING`: that
    of the longest measured length <= the call's `sequence_length`), or None
    (no ranking for this device and kind of call, or a call shorter than every measured
    length)."""
    entry = tuning.pick(plan, *RANKING, {"T": [], "fastest": []})
    L = sequence_length(plan)
    below = [(t, f) for t, f in zip(entry["T"], entry["fastest"]) if t <= L]
    return max(below)[1] if below else None


def kernel_mode(mode: str, plan: Plan) -> str:
    """Resolve the Triton kernel family: `mode` itself when named, else (mode="auto") the
    device table's ranked family (`ranked`) where it takes the plan's head dims, else
    `cost_choice`."""
    if mode != "auto":
        return mode
    first = ranked(plan)
    if first in HEAD_DIMS and refusal(plan, first) is None:
        return first
    return cost_choice(plan)


def cost_choice(plan: Plan) -> str:
    """"chunk" or "fused_recurrent": the cheaper by `kernel_costs` of those that take the
    plan's head dims (`refusal`), the fused kernel on a tie."""
    cost = kernel_costs(plan)
    return min(("fused_recurrent", "chunk"),
               key=lambda m: (refusal(plan, m) is not None, cost[m]))
