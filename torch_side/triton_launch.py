"""The autograd Function over the `bridge` kernels, launched on torch tensors.

On CUDA tensors the kernels compile for the GPU; on CPU tensors they run in
Triton's interpreter (`bridge.kernels` switches it on when no GPU driver is
active), which is exact but slow: about 3 ms per time step per program.
"""

import torch

from bridge import grads
from bridge.kernels import INTERPRETED
from bridge.kernels import family
from bridge.torch_runner import run

ARGS = grads.INPUTS


def _check_device(q):
    if q.device.type == "cpu" and not INTERPRETED:
        raise ValueError("q: platform='triton' on CPU tensors needs the Triton interpreter; "
                         "set TRITON_INTERPRET=1 before anything imports triton, or use "
                         "platform='torch'")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: platform='triton' runs on CUDA (or CPU, interpreted) tensors, "
                         f"got device {q.device}")


class TritonKernels(torch.autograd.Function):
    """The `bridge` kernels of `mode` ("chunk" or "fused_recurrent"). Inputs in the
    batched layout, contiguous; absent ones are None.
    Returns (o [B,T,H,V], final_state [N,H,K,V] fp32)."""

    @staticmethod
    def forward(ctx, plan, mode, cu_seqlens, q, k, v, g, gk, gv, g_gamma, initial_state):
        _check_device(q)
        env = dict(zip(ARGS, (q, k, v, g, gk, gv, g_gamma, initial_state)), cu_seqlens=cu_seqlens)
        env = run(family(mode).forward_launches(plan), env)
        ctx.plan, ctx.mode = plan, mode
        ctx.save_for_backward(cu_seqlens, q, k, v, g, gk, gv, g_gamma, initial_state,
                              env["final_state"])
        ctx.set_materialize_grads(False)
        return env["o"], env["final_state"]

    @staticmethod
    def backward(ctx, do, dfinal_state):
        plan = ctx.plan
        cu_seqlens, *inputs, final_state = ctx.saved_tensors
        if do is None:
            do = torch.zeros(inputs[0].shape[:-1] + inputs[2].shape[-1:], dtype=torch.float32,
                             device=inputs[0].device)
        env = dict(zip(ARGS, inputs), cu_seqlens=cu_seqlens, final_state=final_state,
                   do=do.contiguous(),
                   dfinal_state=None if dfinal_state is None else dfinal_state.contiguous())
        kernels = family(ctx.mode)
        env = run(kernels.backward_launches(plan, use_dht=dfinal_state is not None), env)
        got = grads.assemble(plan, env)
        return (None, None, None, *(None if x is None else got[name].to(x.dtype)
                                    for name, x in zip(ARGS, inputs)))
