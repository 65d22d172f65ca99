"""The `bridge` kernels launched on torch tensors: the bodies of the Triton path of the
`gla_bridge` ops (torch_side/custom_ops.py), which own autograd.

On CUDA tensors the kernels compile for the GPU; on CPU tensors they run in
Triton's interpreter (`bridge.kernels` switches it on when no GPU driver is
active), which is exact but slow: about 3 ms per time step per program.
`wrap=True` launches through `torch.library.wrap_triton`, so that a trace
(Inductor, on CUDA) sees each kernel call instead of an opaque op.
"""

import torch

from bridge import grads
from bridge.kernels import INTERPRETED
from bridge.kernels import family
from bridge.torch_runner import run


def check_device(q):
    """ValueError unless the Triton kernels can run on q's device (before any launch)."""
    if q.device.type == "cpu" and not INTERPRETED:
        raise ValueError("q: platform='triton' on CPU tensors needs the Triton interpreter; "
                         "set TRITON_INTERPRET=1 before anything imports triton, or use "
                         "platform='torch'")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: platform='triton' runs on CUDA (or CPU, interpreted) tensors, "
                         f"got device {q.device}")


def forward(plan, mode, inputs, cu_seqlens, wrap=False):
    """inputs: {name of `bridge.grads.INPUTS`: tensor in the batched layout, contiguous,
    or None}. Returns (o [B,T,H,V] in q's dtype, final_state [N,H,K,V] fp32)."""
    env = run(family(mode).forward_launches(plan), dict(inputs, cu_seqlens=cu_seqlens),
              wrap=wrap)
    return env["o"], env["final_state"]


def backward(plan, mode, inputs, cu_seqlens, final_state, do, dfinal_state, wrap=False):
    """{name: gradient} of the present inputs, each in its input's dtype and shape.
    `final_state` only where the launches read it (`needs_final_state`); `do` or
    `dfinal_state` may be None (no cotangent)."""
    q, v = inputs["q"], inputs["v"]
    if do is None:
        do = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)
    env = dict(inputs, cu_seqlens=cu_seqlens, final_state=final_state, do=do.contiguous(),
               dfinal_state=None if dfinal_state is None else dfinal_state.contiguous())
    env = run(family(mode).backward_launches(plan, use_dht=dfinal_state is not None), env,
              wrap=wrap)
    got = grads.assemble(plan, env)
    return {n: got[n].to(x.dtype) for n, x in inputs.items() if x is not None}


def needs_final_state(plan, mode) -> bool:
    """Whether the backward launches read the forward's final state (so autograd saves it)."""
    if mode != "chunk":
        return False
    from bridge.kernels.common import key_gated

    return plan.gv or key_gated(plan)
