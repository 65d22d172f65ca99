"""Which implementation runs a call: the platform (`route`) and, with the Triton
kernels, the kernel family (`kernel_mode`, by the estimated costs of
`kernel_costs`). The argument contract itself is `bridge.contract`."""

from __future__ import annotations

from .contract import Plan

MODES = ("auto", "chunk", "fused_recurrent")


def route(platform, mode, platforms, fallback: str, gpu: bool, tpu: bool = False) -> str:
    """Validate `platform` and `mode` and resolve "auto": the Triton kernels on a
    GPU (or when mode="fused_recurrent" asks for them), Pallas on a TPU, else
    `fallback`, the framework's own chunked path ("torch" or "xla")."""
    if platform not in platforms:
        raise ValueError(f"platform: expected one of {platforms}, got {platform!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if platform == "auto":
        platform = ("triton" if gpu or mode == "fused_recurrent"
                    else "pallas" if tpu else fallback)
    if platform in (fallback, "pallas") and mode == "fused_recurrent":
        raise ValueError(f"mode: 'fused_recurrent' is a Triton kernel; platform='{platform}' "
                         f"computes the chunked form (use mode='auto' or 'chunk')")
    return platform


# mode="auto" with the Triton kernels: a cost rule over the two things that set
# a small call's time on a GPU, launches and sequential steps per program.
# The fused recurrent kernel is one launch whose programs walk every token of a
# sequence (a rank-1 state update a step); the chunked forward is three
# launches whose only sequential part, the state pass, walks one 64-token chunk
# (a 64x64 matmul) a step. The constants are estimates (microseconds on an
# H100-class GPU), not fitted: the one GPU session (BENCHMARKS.md) timed large
# batches only, where the chunked forward won at every T >= 512 (1.02 vs 1.27 ms
# at (8,512,16,128,128) bf16), as these constants predict; short-sequence latency
# is unmeasured. They put the crossover near 80 tokens a sequence.
LAUNCH_US = 4.0        # launch and Triton dispatch overhead
FUSED_STEP_US = 0.12   # one token of the fused recurrence
CHUNK_STEP_US = 1.5    # one 64-token chunk of the state pass
CHUNK_LEN = 64
LAUNCHES = {"fused_recurrent": 1, "chunk": 3}


def kernel_costs(plan: Plan) -> dict:
    """Estimated forward cost (us) of each Triton family for this call. The
    sequence length is T, or the mean length total/N with cu_seqlens (the
    lengths may be traced, so the longest is not known)."""
    L = plan.T if not plan.varlen else -(-plan.T // max(plan.N, 1))
    return {"fused_recurrent": LAUNCHES["fused_recurrent"] * LAUNCH_US + L * FUSED_STEP_US,
            "chunk": LAUNCHES["chunk"] * LAUNCH_US + -(-L // CHUNK_LEN) * CHUNK_STEP_US}


def kernel_mode(mode: str, plan: Plan) -> str:
    """Resolve the Triton kernel family: "chunk" or "fused_recurrent" (for
    mode="auto", the cheaper by `kernel_costs`; the fused kernel on a tie)."""
    if mode != "auto":
        return mode
    cost = kernel_costs(plan)
    return "fused_recurrent" if cost["fused_recurrent"] <= cost["chunk"] else "chunk"
