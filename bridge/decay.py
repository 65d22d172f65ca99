"""The key-side log decay of SPEC.md, a_t = g_t + gk_t + g_gamma, written once.

Plain `+` and broadcasting only, so NumPy, torch and JAX arrays all pass through
(a framework computing in a wider dtype casts each term before handing it in).
"""


def key_decay(g=None, gk=None, gamma=None):
    """g + gk + gamma, summed in that order over the terms given (None where absent),
    broadcast against each other (g [..., K] or [..., 1], gk [..., K], gamma [..., 1]);
    None when none is given (no key-side decay)."""
    a = None
    for x in (g, gk, gamma):
        if x is not None:
            a = x if a is None else a + x
    return a


# A log decay at or below -RESET_FLOOR is a full reset: every decay spanning it is
# exp(<= -RESET_FLOOR) = 0 (in float64 too) and so is its gradient. The chunked paths clamp
# gates there, so -inf (log 0) never meets the zeros of a masked or triangular product
# (0 * -inf is NaN) and sums of clamped gates stay finite; 2^15 is exact in every float
# dtype, float16 included.
RESET_FLOOR = 32768.0
