"""The `bridge` kernels launched on torch tensors: the bodies of the Triton path of the
`gla_bridge` ops (torch_side/custom_ops.py), which own autograd.

On CUDA tensors the kernels compile for the GPU; on CPU tensors they run in
Triton's interpreter (`bridge.kernels` switches it on when no GPU driver is
active), which is exact but slow: about 3 ms per time step per program.
`wrap=True` launches through `torch.library.wrap_triton`, so that a trace
(Inductor, on CUDA) sees each kernel call instead of an opaque op.

The forward returns the buffer the family's backward reuses (`kept`: chunk's A), which
autograd keeps, so the backward reads it instead of recomputing it.
"""

import torch

from bridge import grads
from bridge.kernels import family
from bridge.launch import resolve_dtype
from bridge.torch_runner import run


def kept(plan, mode):
    """The name of the forward buffer the backward of `mode` reuses under `plan`
    (`bridge.kernels.family(mode).kept`), or None. The ops carry at most one."""
    names = family(mode).kept(plan)
    if len(names) > 1:
        raise ValueError(f"mode: the {mode!r} backward reuses {names}; the gla_bridge ops "
                         f"carry one kept buffer")
    return names[0] if names else None


def kept_like(plan, mode, q):
    """An empty tensor shaped as the forward's kept buffer (chunk's A [B,T,H,BT]), for the
    fake rule; None if `mode` keeps nothing. Shape and dtype from the launch list."""
    name = kept(plan, mode)
    if name is None:
        return None
    out = next(o for launch in family(mode).forward_launches(plan)
               for o in launch.outputs.values() if o is not None and o.name == name)
    dtype = resolve_dtype(out.dtype, {"q": q})
    return q.new_empty(out.shape, dtype=getattr(torch, dtype) if isinstance(dtype, str)
                       else dtype)


def forward(plan, mode, inputs, cu_seqlens, wrap=False, keep=True):
    """inputs: {name of `bridge.contract.INPUTS`: tensor in the batched layout, contiguous,
    or None}. Returns (o [B,T,H,V] in q's dtype, final_state [N,H,K,V] fp32, the kept
    buffer (`kept`) or None). keep=False: no backward follows (the buffer is None, and
    fused_chunk does not write its A)."""
    env = run(family(mode).forward_launches(plan, keep=keep),
              dict(inputs, cu_seqlens=cu_seqlens), wrap=wrap)
    name = kept(plan, mode) if keep else None
    return env["o"], env["final_state"], None if name is None else env[name]


def backward(plan, mode, inputs, cu_seqlens, final_state, kept_buffer, do, dfinal_state,
             wrap=False):
    """{name: gradient} of the present inputs, each in its input's dtype and shape.
    `final_state` only where the launches read it (`needs_final_state`); `kept_buffer`:
    the forward's (`forward`), or None to recompute it; `do` or `dfinal_state` may be
    None (no cotangent)."""
    q, v = inputs["q"], inputs["v"]
    if do is None:
        do = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)
    env = dict(inputs, cu_seqlens=cu_seqlens, final_state=final_state, do=do.contiguous(),
               dfinal_state=None if dfinal_state is None else dfinal_state.contiguous())
    name = None if kept_buffer is None else kept(plan, mode)
    reused = () if name is None else (name,)
    if name is not None:
        env[name] = kept_buffer
    env = run(family(mode).backward_launches(plan, use_dht=dfinal_state is not None,
                                             kept=reused), env, wrap=wrap)
    got = grads.assemble(plan, env)
    return {n: got[n].to(x.dtype) for n, x in inputs.items() if x is not None}


def needs_final_state(plan, mode) -> bool:
    """Whether the backward launches read the forward's final state (so autograd saves it)."""
    if mode != "chunk":
        return False
    from bridge.kernels.common import key_gated

    return plan.gv or key_gated(plan)
