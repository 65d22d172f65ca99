"""The recurrence as `torch.library` custom ops, so torch.compile(fullgraph=True),
torch.export, autocast and torch.func.vmap see one node per call.

    gla_bridge::fwd(q, k, v, g?, gk?, gv?, g_gamma?, initial_state?, cu_seqlens?,
                    scale, reverse, mode)
        -> (o [B,T,H,V] in q's dtype, final_state [N,H,K,V], kept)
    gla_bridge::bwd(the same inputs, final_state?, kept?, do?, dfinal_state?, scale,
                    reverse, mode) -> [gradient of each present input, in its dtype and shape]

Inputs are in the batched layout (packed inputs viewed as [1, total, H, *]), contiguous,
already validated by `bridge.contract.check` (ops.recurrent calls it first; the op
checks only the cu_seqlens values it reads, `checks_offsets`). `mode`: "torch" (the
chunked torch path, torch_side/native.py; final_state float64 for float64 q, else
float32) or a Triton family, "chunk" / "fused_recurrent" / "fused_chunk" (final_state
float32).
`kept`: the forward buffer the backward reuses instead of recomputing
(`triton_launch.kept`: chunk's A [B,T,H,BT] under the default plan), else an empty
[B,0,H,0] (a fixed schema; token-shaped, so DTensor and vmap place it like A).

One forward body, `forward`, serves the op and ops.recurrent's direct calls (`direct`).
Autograd: `bwd` is the registered backward (one node in a compiled backward graph); it
saves the inputs and, only where the Triton launches read them, the final state and the
kept buffer. Mode "torch" recomputes its forward inside `bwd` (the tensors it would save
have shapes that depend on the gate values, so they cannot be op outputs). No double
backward; torch.func grad/vjp refuse torch's generated custom-op autograd Function
(torch.autograd works).
Autocast (cpu and cuda): q, k, v run in the autocast dtype, gates and states in float32
(log decays summed over many steps lose too much in 16 bits); inside, the ops
accumulate in float32 with autocast off. vmap: the mapped axis folds into the batch (into
the packed sequences with cu_seqlens): one launch. On CUDA, under torch.compile, the
Triton path decomposes into `gla_bridge::triton_fwd` / `triton_bwd` (torch.library
triton_op, launches through wrap_triton), so Inductor sees the kernels; on CPU the
interpreted launches stay inside the opaque op. The private torch APIs all of this needs
sit in torch_side/torch_internals.py.
"""

from typing import Optional

import torch
from torch import Tensor

from bridge import contract
from bridge.kernels import INTERPRETED
from . import dtensor, torch_internals, triton_launch
from .native import recurrent_native, recurrent_native_backward

MODES = ("torch", "chunk", "fused_recurrent", "fused_chunk")
# Triton compiles for a GPU here: the CUDA path goes through triton_op (see module doc)
CUDA_TRITON = not INTERPRETED and torch.cuda.is_available()


def _named(*arrays) -> dict:
    """The op's array arguments (schema order, `contract.INPUTS`) by name, as every layer
    below takes them."""
    return dict(zip(contract.INPUTS, arrays))


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def _kept_output(q, kept) -> Tensor:
    """The op's `kept` output: the forward's kept buffer, or where the mode keeps nothing
    (None) an empty [B, 0, H, 0] (see the module doc)."""
    return q.new_empty(q.shape[0], 0, q.shape[2], 0) if kept is None else kept


def _distinct(grads, inputs):
    """Custom op outputs may alias neither an input nor each other (g and gk share one
    gate gradient): clone any that would. An empty gradient (no tokens) may be a view of
    an input with no data to compare: always a fresh one."""
    seen = {x.untyped_storage().data_ptr() for x in inputs if x is not None and x.numel()}
    out = []
    for d in grads:
        if not d.numel():
            out.append(d.new_empty(d.shape))
            continue
        ptr = d.untyped_storage().data_ptr()
        if ptr in seen:
            d = d.clone()
            ptr = d.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(d)
    return out


def direct(inputs: dict, cu_seqlens=None) -> bool:
    """Whether a call may run `forward` itself instead of the op: nothing the op exists
    for is active (autograd recording, torch.compile / export tracing, torch.func
    transforms, autocast, tensor subclasses such as DTensor or fake tensors, dispatch
    modes). Then both give the same result, and a decoding step no longer spends more time
    in the dispatcher than in the recurrence. `inputs`: the arrays by name (None where
    absent); `cu_seqlens`: the offsets or None."""
    grad = torch.is_grad_enabled()
    for x in (*inputs.values(), cu_seqlens):
        if x is not None and (type(x) is not torch.Tensor or (grad and x.requires_grad)):
            return False
    # autocast on any device counts (cheaper than reading the inputs' device)
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing()
                or torch_internals.transform_active() or torch_internals.autocast_active()
                or torch_internals.dispatch_mode_active())


def checks_offsets(mode, cu_seqlens) -> bool:
    """Whether `fwd` reads and checks the values of the cu_seqlens it is given: where that
    costs no device sync (the torch path, or offsets on the CPU). Traced by the caller
    (torch.compile, vmap), they are concrete only there; otherwise ops.recurrent leaves
    them to the op, so each call checks them once."""
    return cu_seqlens is not None and (mode == "torch" or cu_seqlens.device.type == "cpu")


def forward(plan, mode, inputs, cu_seqlens, keep=True):
    """The forward of every call, the body of `fwd` and of ops.recurrent's direct calls:
    the torch path or the Triton launches on `inputs` (the arrays by name, as `_named`
    gives them) with their contract Plan (its scale and reverse are read, its `packed`
    is not). Returns (o, final_state, the kept buffer or None; None without `keep`, for
    the direct calls, which no backward follows). Autocast is off here: a direct call has
    none (`direct`), the op turns it off around this."""
    if mode == "torch":
        o, final_state = recurrent_native(plan, **inputs, cu_seqlens=cu_seqlens)
        return o, final_state, None
    return triton_launch.forward(plan, mode, inputs, cu_seqlens, keep=keep)


@torch.library.custom_op("gla_bridge::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], gk: Optional[Tensor],
        gv: Optional[Tensor], g_gamma: Optional[Tensor], initial_state: Optional[Tensor],
        cu_seqlens: Optional[Tensor], scale: float, reverse: bool,
        mode: str) -> tuple[Tensor, Tensor, Tensor]:
    _check_mode(mode)
    if checks_offsets(mode, cu_seqlens):
        contract.check_offsets(cu_seqlens, q.shape[1])
    inputs = _named(q, k, v, g, gk, gv, g_gamma, initial_state)
    plan = contract.Plan.of_batched(inputs, cu_seqlens, scale=scale, reverse=reverse)
    with torch_internals.no_autocast(q):
        o, final_state, kept = forward(plan, mode, inputs, cu_seqlens)
    return o, final_state, _kept_output(q, kept)


@fwd.register_fake
def _fwd_fake(q, k, v, g, gk, gv, g_gamma, initial_state, cu_seqlens, scale, reverse, mode):
    plan = contract.Plan.of_batched(_named(q, k, v, g, gk, gv, g_gamma, initial_state),
                                    cu_seqlens, scale=scale, reverse=reverse)
    wide = mode == "torch" and q.dtype == torch.float64
    kept = None if mode == "torch" else triton_launch.kept_like(plan, mode, q)
    return (q.new_empty(plan.shape("o")),
            q.new_empty(plan.shape("final_state"),
                        dtype=torch.float64 if wide else torch.float32),
            _kept_output(q, kept))


@torch.library.custom_op("gla_bridge::bwd", mutates_args=())
def bwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], gk: Optional[Tensor],
        gv: Optional[Tensor], g_gamma: Optional[Tensor], initial_state: Optional[Tensor],
        cu_seqlens: Optional[Tensor], final_state: Optional[Tensor], kept: Optional[Tensor],
        do: Optional[Tensor], dfinal_state: Optional[Tensor], scale: float, reverse: bool,
        mode: str) -> list[Tensor]:
    _check_mode(mode)
    inputs = _named(q, k, v, g, gk, gv, g_gamma, initial_state)
    plan = contract.Plan.of_batched(inputs, cu_seqlens, scale=scale, reverse=reverse)
    with torch_internals.no_autocast(q):
        if mode == "torch":
            got = recurrent_native_backward(plan, inputs, cu_seqlens, do, dfinal_state)
        else:
            got = triton_launch.backward(plan, mode, inputs, cu_seqlens, final_state, kept,
                                         do, dfinal_state)
    # contiguous, as the fake promises (a [N,H] g_gamma's gradient can come transposed)
    return _distinct([got[n].contiguous() for n in contract.INPUTS if inputs[n] is not None],
                     (*inputs.values(), final_state, kept, do, dfinal_state))


@bwd.register_fake
def _bwd_fake(q, k, v, g, gk, gv, g_gamma, initial_state, cu_seqlens, final_state, kept,
              do, dfinal_state, scale, reverse, mode):
    return [x.new_empty(x.shape) for x in (q, k, v, g, gk, gv, g_gamma, initial_state)
            if x is not None]


def _setup_context(ctx, inputs, output):
    *arrays, cu, scale, reverse, mode = inputs
    _, final_state, kept = output
    ctx.mark_non_differentiable(kept)
    keep_state = keep_buffer = False  # only what the Triton launches read
    if mode != "torch":
        plan = contract.Plan.of_batched(_named(*arrays), cu, scale=scale, reverse=reverse)
        keep_state = triton_launch.needs_final_state(plan, mode)
        keep_buffer = triton_launch.kept(plan, mode) is not None
    ctx.save_for_backward(*arrays, cu, final_state if keep_state else None,
                          kept if keep_buffer else None)
    ctx.scale, ctx.reverse, ctx.mode = scale, reverse, mode
    ctx.set_materialize_grads(False)  # an unused output's cotangent stays None: less work


def _backward(ctx, do, dfinal_state, _dkept):
    *inputs, cu, final_state, kept = ctx.saved_tensors
    args = (*inputs, cu, final_state, kept, do, dfinal_state)
    if dtensor.is_dtensor(inputs[0]):  # each rank's shards, as the forward ran them
        names = (*contract.ARGS, "final_state", "A", "do", "dfinal_state")  # A: see dtensor
        present = [(n, x) for n, x in zip(contract.ARGS, inputs) if x is not None]
        got = iter(dtensor.local_map(
            lambda *a: bwd(*a, ctx.scale, ctx.reverse, ctx.mode), inputs[0],
            list(zip(names, args)), present))
    else:
        got = iter(bwd(*args, ctx.scale, ctx.reverse, ctx.mode))
    return (*(None if x is None else next(got) for x in inputs), None, None, None, None)


fwd.register_autograd(_backward, setup_context=_setup_context)
if dtensor.DTensor:
    dtensor.register_fwd_sharding(torch_internals.overload(fwd))


# ---------------------------------------------------------------- autocast
_LIB = torch.library.Library("gla_bridge", "FRAGMENT")
_LOW = (torch.float16, torch.bfloat16)


def _autocast_kernel(device_type):
    """q, k, v in the autocast dtype; gates and states in float32; then the op with this
    autocast key excluded. The casts are recorded by autograd, so gradients come back in
    each input's own dtype."""
    key = torch_internals.autocast_key(device_type)
    op = torch_internals.overload(fwd)

    def kernel(_keyset, q, k, v, g, gk, gv, g_gamma, initial_state, cu_seqlens, scale,
               reverse, mode):
        low = torch.get_autocast_dtype(device_type)
        to_low = lambda x: x.to(low) if x.dtype == torch.float32 else x
        to_32 = lambda x: None if x is None else x.float() if x.dtype in _LOW else x
        with torch_internals.excluding(key):
            return op(to_low(q), to_low(k), to_low(v), *map(to_32, (
                g, gk, gv, g_gamma, initial_state)), cu_seqlens, scale, reverse, mode)

    _LIB.impl("fwd", kernel, key, with_keyset=True)


for _device_type in ("cpu", "cuda"):
    _autocast_kernel(_device_type)


# ---------------------------------------------------------------- vmap
@fwd.register_vmap
def _fwd_vmap(info, in_dims, q, k, v, g, gk, gv, g_gamma, initial_state, cu_seqlens, scale,
              reverse, mode):
    """Fold the mapped axis X into the batch: [X,B,T,..] -> [X*B,T,..]; with cu_seqlens
    (B = 1) into the packed tokens, the X copies of the offsets shifted by T each."""
    X = info.batch_size
    if in_dims[8] is not None:
        raise ValueError("cu_seqlens: torch.func.vmap over cu_seqlens is not supported; "
                         "pack the sequences into one cu_seqlens instead")

    def lead(x, d):  # the mapped axis first (an unmapped input is broadcast)
        if x is None:
            return None
        return x.movedim(d, 0) if d is not None else x.expand(X, *x.shape)

    arrays = _named(q, k, v, g, gk, gv, g_gamma, initial_state)
    mapped = {n: lead(x, d) for (n, x), d in zip(arrays.items(), in_dims)}
    one = contract.Plan.of_batched({n: None if x is None else x[0] for n, x in mapped.items()},
                                   cu_seqlens, scale=scale, reverse=reverse)
    # an unmapped g_gamma [H] stays one row shared by every problem
    plan = one.folded(X, gamma_per_sequence=in_dims[6] is not None)
    folded = {n: None if x is None else x.reshape(plan.shape(n)).contiguous()
              for n, x in mapped.items() if n in (*contract.TOKENS, "initial_state")}
    if plan.g_gamma == "seq":
        gam = mapped["g_gamma"]  # [X,H] or [X,N,H] -> one row per folded sequence
        if one.g_gamma == "head":
            gam = gam[:, None].expand(X, one.N, one.H)
        g_gamma = gam.reshape(plan.shape("g_gamma")).contiguous()
    if cu_seqlens is not None:
        T = one.T
        shift = torch.arange(X, dtype=cu_seqlens.dtype, device=cu_seqlens.device)[:, None] * T
        cu_seqlens = torch.cat([(cu_seqlens[None, :-1] + shift).reshape(-1),
                                cu_seqlens.new_full((1,), X * T)])
    o, final_state, kept = fwd(*(folded[n] for n in contract.TOKENS), g_gamma,
                               folded["initial_state"], cu_seqlens, scale, reverse, mode)
    # kept is token-shaped (A [B,T,H,BT], or [B,0,H,0] for nothing): unfolded like o
    t = kept.shape[1] if cu_seqlens is None else kept.shape[1] // X
    return (o.reshape(X, *one.shape("o")), final_state.reshape(X, *one.shape("final_state")),
            kept.reshape(X, one.B, t, *kept.shape[2:])), (0, 0, 0)


# ---------------------------------------------------------------- CUDA: triton_op
# Defined everywhere (on CPU they run eagerly, interpreted: wrap_triton passes interpreted
# kernels through), used for the decomposition only where Triton compiles for a GPU.
@torch.library.triton_op("gla_bridge::triton_fwd", mutates_args=())
def triton_fwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], gk: Optional[Tensor],
               gv: Optional[Tensor], g_gamma: Optional[Tensor],
               initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
               reverse: bool, mode: str) -> tuple[Tensor, Tensor, Tensor]:
    inputs = _named(q, k, v, g, gk, gv, g_gamma, initial_state)
    plan = contract.Plan.of_batched(inputs, cu_seqlens, scale=scale, reverse=reverse)
    o, final_state, kept = triton_launch.forward(plan, mode, inputs, cu_seqlens, wrap=True)
    return o, final_state, _kept_output(q, kept)


@torch.library.triton_op("gla_bridge::triton_bwd", mutates_args=())
def triton_bwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], gk: Optional[Tensor],
               gv: Optional[Tensor], g_gamma: Optional[Tensor],
               initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
               final_state: Optional[Tensor], kept: Optional[Tensor], do: Optional[Tensor],
               dfinal_state: Optional[Tensor], scale: float, reverse: bool,
               mode: str) -> list[Tensor]:
    inputs = _named(q, k, v, g, gk, gv, g_gamma, initial_state)
    plan = contract.Plan.of_batched(inputs, cu_seqlens, scale=scale, reverse=reverse)
    got = triton_launch.backward(plan, mode, inputs, cu_seqlens, final_state, kept, do,
                                 dfinal_state, wrap=True)
    got = [got[n] for n in contract.INPUTS if inputs[n] is not None]
    # g and gk share one gate-gradient buffer; outputs may not alias each other
    return [d.clone() if any(d is e for e in got[:i]) else d for i, d in enumerate(got)]


def _decompose(into):
    """Under AOTDispatch's functionalization, a Triton-mode call on CUDA becomes the
    triton_op (whose wrap_triton launches Inductor compiles); export keeps gla_bridge::fwd."""
    def rule(mode, op, types, args, kwargs):
        if (args[-1] == "torch" or args[0].device.type != "cuda"
                or torch_internals.triton_decomposition_disabled()):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            return into(*args, **kwargs)
    return rule


if CUDA_TRITON:
    fwd.register_torch_dispatch(torch_internals.functional_tensor_mode(),
                                _decompose(triton_fwd))
    bwd.register_torch_dispatch(torch_internals.functional_tensor_mode(),
                                _decompose(triton_bwd))
