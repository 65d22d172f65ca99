"""The FLOP count the benchmark divides by: matmul FLOPs of the chunked algorithm.

Per (batch, head) and per chunk of C tokens (the last chunk may be shorter, c <= C),
the chunked GLA forward does four matmuls:
    A       = Q K^T      [c,K] x [K,c]   2 c^2 K
    O_intra = A V        [c,c] x [c,V]   2 c^2 V
    O_inter = Q S        [c,K] x [K,V]   2 c K V
    S      += K^T V      [K,c] x [c,V]   2 c K V
Elementwise gate work (exp, cumsum, scaling) is not counted. The backward is
counted as 2x the forward (the usual convention: two matmuls per forward matmul).
"""

CHUNK = 64


def forward_flops(B: int, T: int, H: int, K: int, V: int, chunk: int = CHUNK) -> int:
    """Matmul FLOPs of one chunked forward over [B,T,H,K] / [B,T,H,V] inputs."""
    if min(B, T, H, K, V, chunk) <= 0:
        raise ValueError(f"sizes must be positive, got B={B} T={T} H={H} K={K} V={V} chunk={chunk}")
    full, rest = divmod(T, chunk)
    per_chunk = lambda c: 2 * c * c * (K + V) + 4 * c * K * V  # noqa: E731
    return B * H * (full * per_chunk(chunk) + (per_chunk(rest) if rest else 0))


def flops(B: int, T: int, H: int, K: int, V: int, mode: str, chunk: int = CHUNK) -> int:
    """FLOPs of `mode` ("fwd" or "fwdbwd" = forward + 2x forward)."""
    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}")
    f = forward_flops(B, T, H, K, V, chunk)
    return f if mode == "fwd" else 3 * f
