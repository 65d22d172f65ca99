"""Every launch grid stays within CUDA's limits: x < 2^31, y and z <= 65,535
(cudaLaunchKernel fails with an invalid configuration beyond them). Checked on
the launch lists both kernel families build, without running anything, for
shapes whose N x H or token count is large: 4,096 packed sequences x 16 heads
(N x H = 65,536, one past the y/z limit) and long batched calls."""

import pytest

from bridge.contract import Plan
from bridge.kernels import family

X_MAX = 2 ** 31 - 1
YZ_MAX = 65535


def _plan(B, T, H, N, K=128, V=128, varlen=False, **gates):
    kw = dict(g="none", gk=False, gv=False, g_gamma="none")
    kw.update(gates)
    return Plan(B=B, T=T, H=H, Hk=H, K=K, V=V, N=N, initial_state=True, scale=K ** -0.5,
                reverse=False, varlen=varlen, packed=varlen, dtype="bfloat16", **kw)


PLANS = {
    # 4,096 packed sequences of 64 tokens x 16 heads
    "packed-4096x16": _plan(1, 4096 * 64, 16, 4096, varlen=True, g="key"),
    # every gate: the backward's gv / g_gamma launches too
    "packed-4096x16-all-gates": _plan(1, 4096 * 64, 16, 4096, varlen=True, g="key", gk=True,
                                      gv=True, g_gamma="seq"),
    # a long batched call: many chunks per sequence
    "batched-8x65536x32": _plan(8, 65536, 32, 8, K=64, V=64, g="head"),
}


def _axes_ok(grid):
    grid = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
    x, y, z = grid
    return len(grid) == 3 and 1 <= x <= X_MAX and 1 <= y <= YZ_MAX and 1 <= z <= YZ_MAX


@pytest.mark.parametrize("mode", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_grid_within_cuda_limits(mode, name):
    """Forward, backward with and without a final-state gradient: every axis of
    every launch within the limits (nothing is launched)."""
    plan = PLANS[name]
    fam = family(mode)
    launches = [("fwd", l) for l in fam.forward_launches(plan)]
    for use_dht in (True, False):
        launches += [(f"bwd(dht={use_dht})", l) for l in fam.backward_launches(plan, use_dht)]
    bad = [(stage, l.kernel.__name__, tuple(l.grid)) for stage, l in launches
           if not _axes_ok(l.grid)]
    assert not bad, bad


def test_limits_are_checked():
    """The check itself: N x H = 65,536 on y or z fails, on x passes."""
    assert _axes_ok((65536, 1, 1)) and _axes_ok((X_MAX,))
    assert not _axes_ok((1, 65536)) and not _axes_ok((1, 1, 65536))
    assert not _axes_ok((2 ** 31, 1, 1)) and not _axes_ok((0, 1, 1))
