"""The chunked torch path's tuning knobs (torch_side/native*.py) in one frozen config,
passed down from the entry points (`recurrent_native(..., config=...)`); the measurements
that set the defaults are in BENCHMARKS.md ("Tuning history of the CPU paths")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NativeConfig:
    """widest_block: the widest in-chunk block of decay factors (whole chunks at the
    default chunk size 64). triangle: the widest triangular matmul that sums gates (wider
    blocks add whole pieces' totals). log_decay_limit: the largest |log decay| an in-block
    factor may carry (exp(30) ~ 1e13: no overflow, and in-block cancellation costs at most
    limit * eps). slab_elements: elements of one slab input [H, slots, C, D], at most; a
    forward slab holds ~20 such arrays besides its output, so a slab input is also kept
    below 1 / slab_output_share of the output (down to slab_elements // 4): fewer, larger
    slabs cost less per op, and since the forward frees each temporary when used, 16 keeps
    its peak below 3x output + state. backward_slab_scale: a backward slab may be this
    many times larger (larger ones ran their matmuls out of cache, for more memory and no
    gain). stepwise_tokens: at most this many tokens a row (decoding) run step by step,
    without chunks."""

    widest_block: int = 64
    triangle: int = 16
    log_decay_limit: float = 30.0
    slab_elements: int = 1 << 18
    slab_output_share: int = 16
    backward_slab_scale: int = 1
    stepwise_tokens: int = 4


DEFAULT = NativeConfig()
