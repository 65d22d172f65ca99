"""`python -m parity --multi-device`: context parallelism in both frameworks on the
same inputs. torch's `context_group` over P gloo processes and JAX's `context_axis`
over P host devices each compute the case with the time axis split P ways; o, the
final state and every gradient are compared with the float64 oracle and with each
other. Each framework runs in child processes of its own (gloo ranks; a JAX process
started with P host devices), which write their results as .npz files.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

from . import backends, cases, spawn
from .compare import errors, tolerance

CASES = [
    cases.Case("cp-gla-state", T=96, H=2, Hk=1, K=8, V=8, g="key", gv=True,
               initial_state=True),
    cases.Case("cp-varlen-reverse", H=2, Hk=2, K=8, V=8, seqlens=(30, 0, 50, 16), g="head",
               gk=True, g_gamma="seq", initial_state=True, reverse=True, packed=True),
]
WHOLE = ("initial_state", "g_gamma", "cu_seqlens")  # every rank / device holds these whole
TIMEOUT_S = 300


def _time_axis(case):
    return 0 if case.packed else 1


def _case(name):
    return next(c for c in CASES if c.name == name)


def _save(path, out):
    np.savez(path, **{n: np.asarray(x, np.float32) for n, x in out.items()})


# ------------------------------------------------------------------------- torch

def _torch_rank(rank, P, name, seed, out_path):
    """One gloo rank (parity.spawn): its time slice through context_group; rank 0 saves
    the gathered results."""
    import torch
    import torch.distributed as dist

    import torch_side

    case = _case(name)
    ax = _time_axis(case)
    t = cases.to_torch({n: a if n in WHOLE or n == "dfinal_state" else
                        np.array_split(a, P, axis=ax)[rank]
                        for n, a in backends.prepared(case, "float32", seed).items()},
                       requires_grad=True)
    kw = cases.call_kwargs(case, t)
    o, state = torch_side.recurrent(**kw, platform="torch", context_group=dist.group.WORLD)
    # the final state is the same on every rank: its cotangent enters once (rank 0)
    loss = (o * t["do"]).sum() + (rank == 0) * (state * t["dfinal_state"]).sum()
    names = [n for n in backends.GRAD_NAMES if n in t]
    grads = dict(zip(names, torch.autograd.grad(loss, [t[n] for n in names])))
    out = {"final_state": state.detach()}
    for n, x in [("o", o.detach())] + [("d" + n, g) for n, g in grads.items()]:
        if n[1:] in WHOLE:  # each rank holds its share: the sum is the gradient
            dist.all_reduce(x)
            out[n] = x
        else:
            parts = [torch.empty_like(x) for _ in range(P)]
            dist.all_gather(parts, x.contiguous())
            out[n] = torch.cat(parts, dim=ax)
    if rank == 0:
        _save(out_path, {n: x.numpy() for n, x in out.items()})


def run_torch(name, P, seed, out_path):
    spawn.gloo(_torch_rank, P, name, seed, out_path, timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------- JAX

def jax_child(name, P, seed, out_path):
    """Runs in a process started with P host devices."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as Spec

    import jax_side

    case = _case(name)
    arrays = backends.prepared(case, "float32", seed)
    mesh = Mesh(np.array(jax.devices()[:P]), ("cp",))
    tok = Spec("cp") if case.packed else Spec(None, "cp")
    x = cases.to_jax(arrays)
    kw = cases.call_kwargs(case, x)
    static = {n: kw.pop(n) for n in ("reverse", "softmax_scale")}
    diff = {n: kw.pop(n) for n in backends.GRAD_NAMES if n in kw}
    spec = lambda n: Spec() if n in WHOLE else tok  # noqa: E731

    def local(diff, rest):
        return jax_side.recurrent(**diff, **rest, **static, platform="xla", context_axis="cp")

    sharded = jax.shard_map(local, mesh=mesh,
                            in_specs=({n: spec(n) for n in diff}, {n: spec(n) for n in kw}),
                            out_specs=(tok, Spec()))

    def loss(diff):
        o, state = sharded(diff, kw)
        return (o * x["do"]).sum() + (state * x["dfinal_state"]).sum(), (o, state)

    (_, (o, state)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)
    _save(out_path, dict(o=o, final_state=state, **{"d" + n: g for n, g in grads.items()}))


def run_jax(name, P, seed, out_path):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={P}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(),
               JAX_PLATFORMS="cpu")
    code = (f"from parity.multi_device import jax_child; "
            f"jax_child({name!r}, {P}, {seed}, {out_path!r})")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"JAX context parallelism over {P} devices failed:\n"
                           f"{proc.stderr[-3000:]}")


# ------------------------------------------------------------------------ compare

def compare(P=2, seed=0, names=None, log=print):
    """Rows (case, against, worst relative error, ok) for torch-cp and jax-cp against
    the oracle and each other."""
    rows = []
    tol = tolerance("float32")
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if names and case.name not in names:
                continue
            arrays = backends.prepared(case, "float32", seed)
            want = backends.Oracle().run(case, arrays, "float32")
            got = {}
            for fw, runner in (("torch", run_torch), ("jax", run_jax)):
                path = os.path.join(tmp, f"{case.name}-{fw}.npz")
                runner(case.name, P, seed, path)
                got[fw] = dict(np.load(path))
            for label, a, b in (("torch-cp vs oracle", got["torch"], want),
                                ("jax-cp vs oracle", got["jax"], want),
                                ("torch-cp vs jax-cp", got["torch"], got["jax"])):
                errs = errors(a, b, case.gate_grad_floor)
                worst = max(errs.values())
                rows.append((case.name, label, worst, worst <= tol))
                log(f"{case.name:22s} P={P} {label:20s} {worst:.1e} "
                    f"{'ok' if worst <= tol else 'MISMATCH'}")
    return rows
