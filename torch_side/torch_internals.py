"""Every private torch API the torch side uses, each behind one small function.

torch.library's public surface covers custom ops, fake tensors, autograd and vmap, but not
these: asking whether a torch.func transform or a dispatch mode is active (the direct
path must step aside for them), excluding one autocast key around the op's own call, and
the functionalization mode under which the CUDA decomposition hooks in. Each function
says why it is needed and what to look at when a torch upgrade breaks it (checked with
torch 2.13).
"""

import contextlib

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_NOTHING = contextlib.nullcontext()  # reentrant: one for every call


def transform_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp) is tracing the current call.

    Why: ops.recurrent runs the op's body directly only when nothing wraps the call, and
    treats cu_seqlens values as traced under a transform. No public query exists.
    Upgrade: `torch._C._functorch.peek_interpreter_stack` returns None outside any
    transform; if it moves or is renamed, the direct path would run under vmap (wrong
    results) and this raises AttributeError at the first call instead."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def autocast_active() -> bool:
    """Whether autocast is on for any device type.

    Why: one call instead of one `torch.is_autocast_enabled(device)` per device type, on
    the decoding step's direct path (its cost is the point of that path).
    Upgrade: `torch._C._is_any_autocast_enabled`; a per-device loop over
    torch.is_autocast_enabled is the public replacement."""
    return torch._C._is_any_autocast_enabled()


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode (FakeTensorMode, FunctionalTensorMode, a debug mode)
    is on the stack.

    Why: under such a mode the op must run through the dispatcher (the mode intercepts
    it), never the direct path. Upgrade: `torch.utils._python_dispatch.
    _get_current_dispatch_mode` returns the innermost mode or None (imported at the top:
    an import per call would cost more than the check)."""
    return _get_current_dispatch_mode() is not None


def no_autocast(x):
    """A context with autocast off on tensor x's device type when any autocast is on, else
    a no-op (entering torch.autocast, even reading x's device, costs more than the check
    on a decoding step). The op accumulates in float32 itself: autocast must not downcast
    its internals."""
    if not autocast_active():
        return _NOTHING
    return torch.autocast(x.device.type, enabled=False)


def autocast_key(device_type: str) -> str:
    """The name of the dispatch key of autocast on `device_type` ("AutocastCPU", ...),
    under which the op's autocast rule is registered.

    Why: torch.library registers a kernel for a key by name, and autocast's key per
    device has no public mapping. Upgrade: `torch._C._dispatch_key_for_device` maps
    "cpu" -> "CPU", "cuda" -> "CUDA"; a wrong name fails at import (Library.impl)."""
    return "Autocast" + torch._C._dispatch_key_for_device(device_type)


def excluding(key: str):
    """A context in which dispatch key `key` is skipped: the autocast rule calls the op
    again with its own key excluded (else it would call itself forever).

    Upgrade: `torch._C.DispatchKeySet`, `torch._C.DispatchKey` and
    `torch._C._ExcludeDispatchKeyGuard`, the C++ guard's Python binding."""
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    return torch._C._ExcludeDispatchKeyGuard(keys)


def overload(op):
    """The OpOverload (torch.ops.gla_bridge.<name>.default) behind a torch.library
    custom_op / triton_op object.

    Why: DTensor's register_sharding and the autocast rule take or call the overload, and
    CustomOpDef exposes it only as `_opoverload` (the public spelling,
    torch.ops.<namespace>.<name>.default, would repeat the op's name here).
    Upgrade: if `_opoverload` goes, look the op up by its qualified name."""
    return op._opoverload


def functional_tensor_mode():
    """The FunctionalTensorMode class: AOTDispatch's functionalization, the point at which
    the CUDA decomposition into triton_ops registers itself (as torch's own triton_op
    decompositions do).

    Upgrade: `torch._subclasses.functional_tensor.FunctionalTensorMode`; if it moves,
    import fails only where Triton compiles for a GPU (custom_ops.CUDA_TRITON)."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    return FunctionalTensorMode


def triton_decomposition_disabled() -> bool:
    """Whether torch.export asked to keep triton_ops whole (then the decomposition must
    not run: export keeps gla_bridge::fwd).

    Upgrade: `torch.export._trace.custom_triton_ops_decomposition_disabled`."""
    from torch.export._trace import custom_triton_ops_decomposition_disabled

    return custom_triton_ops_decomposition_disabled()


def shard_cache_keyed_from(op, argnum: int):
    """Key DTensor's sharding-propagation cache for OpOverload `op` on its non-DTensor
    arguments from index `argnum` on too (the DTensor arguments' specs always count).

    Why: register_sharding keys the cache on the DTensor arguments and int arguments
    only; gla_bridge::fwd's mode (a str) is not one, so a call in one mode would reuse the
    output shapes and dtypes propagated for another (the kept buffer, [B,0,H,0] or chunk's
    A [B,T,H,BT]; the final state, float64 or float32): wrong global metadata on the
    output DTensors. Upgrade: `DTensor._op_dispatcher.sharding_propagator.
    op_to_schema_info` and `torch.distributed.tensor._op_schema.RuntimeSchemaInfo`
    (register_sharding's own choice is `RuntimeSchemaInfo(first int arg,
    needs_pytree=True)`); test_torch_distributed's mode-switching case catches a change."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_to_schema_info[op] = RuntimeSchemaInfo(argnum, needs_pytree=True)
