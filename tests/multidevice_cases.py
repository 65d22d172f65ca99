"""Checks on 8 host devices, run in a subprocess by tests/test_jax_multidevice.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/multidevice_cases.py [GROUP ...]

prints one JSON line per check: {"name", "err" (parity.compare.rel_err against the
reference), "tol", ...}; the test asserts on them. Each check compares with an
independent result: the float64 oracle (parity/oracle.py) and the same call on one
device. GROUP: "vma" (shard_map with check_vma=True, batch/head sharding),
"context" (context parallelism), "jit" (sharded inputs under plain jax.jit),
"hlo" (collectives of the compiled programs), "readme" (README's "Many devices"
example); all of them by default.
GLA_MULTIDEVICE=full runs the whole matrix (`plan`).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_side  # noqa: E402
from bridge.contract import TOKENS  # noqa: E402
from parity import cases, oracle  # noqa: E402
from parity.compare import rel_err  # noqa: E402
from parity.bench.multidevice import collective_bytes  # noqa: E402

NAMES = cases.INPUTS


def report(name, err, tol, **extra):
    print(json.dumps(dict(name=name, err=float(err), tol=tol, **extra)), flush=True)


def problem(seed, case):
    """(recurrent's float32 inputs by name, cu_seqlens or None, do, dfinal_state) of a
    `parity.cases.Case`."""
    x, cot = cases.split(cases.inputs(case, seed))
    return x, x.pop("cu_seqlens", None), cot["do"], cot["dfinal_state"]


def oracle_all(x, cu, reverse, do, dfin):
    o, fin = oracle.recurrent(**x, reverse=reverse, cu_seqlens=cu)
    grads = oracle.recurrent_grads(**x, reverse=reverse, cu_seqlens=cu, do=do,
                                   dfinal_state=dfin)
    return o, fin, grads


def loss_fn(call, names):
    """L = sum(o * do) + sum(final * dfin) of call(**inputs)."""
    def loss(arrays, do, dfin):
        o, fin = call(**dict(zip(names, arrays)))
        return jnp.sum(o * do) + jnp.sum(fin * dfin)
    return loss


def check_all(tag, got_o, got_fin, got_grads, want, tol):
    o, fin, grads = want
    report(f"{tag} o", rel_err(got_o, o), tol)
    report(f"{tag} final_state", rel_err(got_fin, fin), tol)
    for n, gr in got_grads.items():
        report(f"{tag} d{n}", rel_err(gr, grads[n]), tol)


C = cases.Case
CONTEXT_CASES = {  # packed: sequence boundaries that do not line up with 2, 4 or 8 slices
    "gla_gv_h0": C(B=2, T=32, H=2, Hk=1, K=8, V=8, g="key", gv=True, initial_state=True),
    "head_gamma_rev": C(B=1, T=32, H=2, Hk=2, K=8, V=4, g="head", g_gamma="head",
                        initial_state=True, reverse=True),
    "varlen": C(H=2, Hk=1, K=8, V=8, packed=True, seqlens=(5, 8, 1, 10), gk=True,
                g_gamma="seq", initial_state=True),
    "varlen_rev": C(H=2, Hk=2, K=4, V=8, packed=True, seqlens=(4, 7, 2, 7, 4), g="key",
                    gv=True, initial_state=True, reverse=True),
    "lightning": C(B=2, T=16, H=4, Hk=4, K=8, V=8, g_gamma="head"),
}


def context_check(platform, devices, case):
    reverse = CONTEXT_CASES[case].reverse
    x, cu, do, dfin = problem(3, CONTEXT_CASES[case])
    names = tuple(n for n in NAMES if n in x)
    want = oracle_all(x, cu, reverse, do, dfin)
    packed = cu is not None
    tok = P("cp") if packed else P(None, "cp")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("cp",))
    extra = {} if cu is None else {"cu_seqlens": jnp.asarray(cu)}

    def call(**a):
        return jax_side.recurrent(**a, **extra, reverse=reverse, platform=platform,
                                  context_axis="cp")

    specs = tuple(tok if n in TOKENS else P() for n in names)
    sharded = lambda **a: jax.shard_map(  # noqa: E731
        lambda *arr: call(**dict(zip(names, arr))), mesh=mesh, in_specs=specs,
        out_specs=(tok, P()))(*(a[n] for n in names))
    arrays = [jnp.asarray(x[n]) for n in names]
    o, fin = jax.jit(lambda arr: sharded(**dict(zip(names, arr))))(arrays)
    grads = jax.jit(jax.grad(loss_fn(sharded, names)))(arrays, do, dfin)
    tag = f"context {platform} P={devices} {case}"
    check_all(tag, o, fin, dict(zip(names, grads)), want, 2e-4)
    # and the same call on one device
    single = lambda **a: jax_side.recurrent(**a, **extra, reverse=reverse,  # noqa: E731
                                            platform=platform)
    o1, fin1 = single(**dict(zip(names, arrays)))
    report(f"{tag} o vs 1 device", rel_err(o, o1), 2e-5)
    report(f"{tag} final_state vs 1 device", rel_err(fin, fin1), 2e-5)


def sharded_problem(mesh, x, specs):
    return [jax.device_put(jnp.asarray(x[n]), NamedSharding(mesh, specs[n])) for n in x]


def vma_and_jit_check(platform, how, case):
    """Batch/head sharding on a (2, 4) mesh: under shard_map (check_vma=True) or
    plain jax.jit with NamedSharding inputs; forward and every gradient."""
    if case == "varlen":  # packed: only heads can be split
        spec = C(H=8, Hk=4, packed=True, seqlens=(9, 14, 9), g="key", gv=True,
                 g_gamma="head", initial_state=True)
    else:
        spec = C(B=2, T=16, H=8, Hk=4, g="key", g_gamma="head", initial_state=True)
    x, cu, do, dfin = problem(5, spec)
    names = tuple(x)
    want = oracle_all(x, cu, False, do, dfin)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("b", "h"))
    b = None if cu is not None else "b"
    lead = (None,) if cu is not None else ("b", None)
    specs = {"q": P(*lead, "h", None), "k": P(*lead, "h", None), "v": P(*lead, "h", None),
             "g": P(*lead, "h", None), "gv": P(*lead, "h", None), "g_gamma": P("h"),
             "initial_state": P(b, "h")}
    extra = {} if cu is None else {"cu_seqlens": jnp.asarray(cu)}

    def call(*arr):
        return jax_side.recurrent(**dict(zip(names, arr)), **extra, platform=platform)

    out_specs = (P(*lead, "h", None), P(b, "h"))
    if how == "shard_map":
        fn = jax.shard_map(call, mesh=mesh, in_specs=tuple(specs[n] for n in names),
                           out_specs=out_specs)
        arrays = [jnp.asarray(x[n]) for n in names]
    else:
        fn = call
        arrays = sharded_problem(mesh, x, specs)
    tag = f"{how} {platform} {case}"
    fwd = jax.jit(fn)
    o, fin = fwd(*arrays)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)[0] * do) + jnp.sum(fn(*a)[1] * dfin),
                            argnums=tuple(range(len(names)))))
    grads = grad(*arrays)
    check_all(tag, o, fin, dict(zip(names, grads)), want, 2e-4)
    if how == "jit":
        keeps = (o.sharding.is_equivalent_to(NamedSharding(mesh, out_specs[0]), o.ndim)
                 and fin.sharding.is_equivalent_to(NamedSharding(mesh, out_specs[1]), 4))
        report(f"{tag} outputs keep the input sharding", 0.0 if keeps else 1.0, 0.5,
               specs=[str(o.sharding.spec), str(fin.sharding.spec)])
        coll = collective_bytes(fwd.lower(*arrays).compile().as_text())
        report(f"{tag} forward collectives (count)", len(coll), 0, found=coll)
        coll = collective_bytes(grad.lower(*arrays).compile().as_text())
        # the backward reduces only g_gamma's gradient ([H] per device) over the batch
        big = [c for c in coll if c[1] > x["g_gamma"].nbytes]
        report(f"{tag} backward collectives larger than g_gamma", len(big), 0, found=coll)


def context_hlo_check(platform, devices, T_local):
    """Bytes of every collective in context parallelism's compiled forward and
    gradient: at most devices x N x H x (K V + K + V) x 4 bytes x 2 per direction."""
    B, H, K, V = 2, 2, 8, 8
    x, _, _, _ = problem(7, C(B=B, T=T_local * devices, H=H, Hk=H, K=K, V=V, g="key", gv=True,
                              initial_state=True))
    names = tuple(x)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("cp",))
    specs = tuple(P(None, "cp") if n in TOKENS else P() for n in names)
    fn = jax.shard_map(lambda *a: jax_side.recurrent(**dict(zip(names, a)), platform=platform,
                                                    context_axis="cp"),
                       mesh=mesh, in_specs=specs, out_specs=(P(None, "cp"), P()))
    arrays = [jnp.asarray(x[n]) for n in names]
    bound = devices * B * H * (K * V + K + V) * 4 * 2
    fwd = collective_bytes(jax.jit(fn).lower(*arrays).compile().as_text())
    loss = lambda *a: jnp.sum(fn(*a)[0]) + jnp.sum(fn(*a)[1])  # noqa: E731
    both = collective_bytes(jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))
                            .lower(*arrays).compile().as_text())
    tag = f"context hlo {platform} P={devices} T/P={T_local}"
    report(f"{tag} forward collective bytes over bound", sum(n for _, n in fwd) / bound, 1.0,
           found=fwd)
    report(f"{tag} forward all-gathers", abs(sum(op == "all-gather" for op, _ in fwd) - 1),
           0, found=fwd)
    report(f"{tag} fwd+bwd collective bytes over 2 x bound", sum(n for _, n in both) / bound / 2,
           1.0, found=both)


def layer_check(devices):
    """gla_apply with context_axis under shard_map == gla_apply on one device,
    output and parameter gradients."""
    from functools import partial

    from bridge.weights import LayerConfig

    cfg = LayerConfig(kind="gla", hidden_size=16, num_heads=2, expand_k=0.5, expand_v=1.0)
    params = jax_side.init_gla(jax.random.PRNGKey(0), cfg)
    xs = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 16))
    mesh = Mesh(np.array(jax.devices()[:devices]), ("cp",))
    one = partial(jax_side.gla_apply, config=cfg, platform="xla")
    cp = jax.shard_map(partial(jax_side.gla_apply, config=cfg, platform="xla", context_axis="cp"),
                       mesh=mesh, in_specs=(P(), P(None, "cp")), out_specs=P(None, "cp"))
    loss = lambda f: (lambda p, x: jnp.sum(jnp.sin(f(p, x))))  # noqa: E731
    report(f"layer gla_apply P={devices} o vs 1 device", rel_err(jax.jit(cp)(params, xs),
                                                              one(params, xs)), 2e-5)
    g1 = jax.grad(loss(one))(params, xs)
    g2 = jax.jit(jax.grad(loss(cp)))(params, xs)
    report(f"layer gla_apply P={devices} parameter grads vs 1 device",
           max(rel_err(g2[n], g1[n]) for n in g1), 2e-5)


def tpu_export_check():
    """platform="pallas" under shard_map (check_vma=True), forward and gradient, exported
    for TPU on this host: the Mosaic kernels lower (tpu_custom_call in the module)."""
    from jax.sharding import AbstractMesh, AxisType

    mesh = AbstractMesh((2,), ("b",), axis_types=(AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((2, 64, 2, 32), jnp.float32, sharding=NamedSharding(mesh, P("b")))
    f = jax.shard_map(lambda q, g: jax_side.recurrent(q, q, q, g=g, platform="pallas"),
                      mesh=mesh, in_specs=(P("b"), P("b")), out_specs=(P("b"), P("b")))
    loss = lambda q, g: jnp.sum(f(q, g)[0]) + jnp.sum(f(q, g)[1])  # noqa: E731
    module = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))),
                               platforms=["tpu"])(x, x).mlir_module()
    calls = module.count("tpu_custom_call")
    report("shard_map pallas TPU export (Mosaic kernels) under check_vma", 0.0 if calls else 1.0,
           0.5, tpu_custom_calls=calls)


def transforms_check():
    """With 8 devices, outside shard_map: jax.vmap of jax.grad (the partitioning rule's
    vmap fallback) equals a loop, and jax.jvp (the plain call) equals finite
    differences, on platform xla."""
    r = np.random.default_rng(8)
    q = jnp.asarray(r.standard_normal((3, 2, 16, 2, 8)), jnp.float32)
    g = jnp.asarray(-r.uniform(0.01, 0.5, (3, 2, 16, 2)), jnp.float32)
    f = lambda q, g: jnp.sum(jax_side.recurrent(q, q, q, g=g, platform="xla")[0] ** 2)  # noqa
    grad = jax.grad(f, argnums=(0, 1))
    batched = jax.jit(jax.vmap(grad))(q, g)
    loop = [jax.jit(grad)(q[i], g[i]) for i in range(3)]  # one compile
    report("jit transforms vmap(grad) vs loop",
           max(rel_err(batched[j][i], loop[i][j]) for i in range(3) for j in range(2)), 1e-5)
    dq = jnp.asarray(r.standard_normal(q[0].shape), jnp.float32)
    _, tangent = jax.jit(lambda x, t: jax.jvp(lambda y: f(y, g[0]), (x,), (t,)))(q[0], dq)
    eps, fj = 1e-3, jax.jit(f)
    fd = (fj(q[0] + eps * dq, g[0]) - fj(q[0] - eps * dq, g[0])) / (2 * eps)
    report("jit transforms jvp vs finite differences", rel_err(tangent, fd), 1e-2)


def empty_check():
    """Context parallelism with no tokens: o is empty, the final state is the initial one."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("cp",))
    q = jnp.zeros((0, 2, 4))
    h0 = jnp.asarray(np.random.default_rng(9).standard_normal((2, 2, 4, 4)), jnp.float32)
    cu = jnp.array([0, 0, 0], jnp.int32)
    f = jax.shard_map(lambda q, h0: jax_side.recurrent(q, q, q, initial_state=h0, cu_seqlens=cu,
                                                       platform="xla", context_axis="cp"),
                      mesh=mesh, in_specs=(P("cp"), P()), out_specs=(P("cp"), P()))
    o, fin = jax.jit(f)(q, h0)
    report("context empty: final state == initial state", rel_err(fin, h0) + o.size, 0.0)


def readme_check():
    """README's "Many devices" example (it asserts its gradient against one device)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
              if b.startswith("# many devices")]
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md many-devices block {i}", "exec"), {})
    report("readme many devices blocks ran", 0.0 if blocks else 1.0, 0.5, blocks=len(blocks))


def plan(full):
    """{group: [(check, args)]}: a small set by default (each platform, 2, 4 and 8
    devices, every gate kind at least once); `full` (GLA_MULTIDEVICE=full) runs every
    platform x device count x case."""
    platforms = ("xla", "pallas", "triton")
    if full:
        context = [(context_check, (p, d, c)) for p in platforms for d in (2, 4, 8)
                   for c in CONTEXT_CASES]
        hlo = [(context_hlo_check, (p, d, t)) for p in ("xla", "pallas") for d in (2, 4, 8)
               for t in (16, 256)]
        vma = [(vma_and_jit_check, (p, "shard_map", c)) for p in platforms
               for c in ("batched", "varlen")] + [(tpu_export_check, ())]
        jit = [(vma_and_jit_check, (p, "jit", c)) for p in ("xla", "pallas")
               for c in ("batched", "varlen")] + [(transforms_check, ())]
    else:
        context = [(context_check, ("xla", 4, "head_gamma_rev")),
                   (context_check, ("xla", 8, "varlen")),
                   (context_check, ("pallas", 8, "lightning")),
                   (context_check, ("triton", 2, "gla_gv_h0"))]
        hlo = [(context_hlo_check, ("xla", 8, 256))]
        vma = [(vma_and_jit_check, (p, "shard_map", "batched")) for p in platforms]
        vma.append((tpu_export_check, ()))
        # not triton under jit: on CPU its interpreter callback is not partitioned
        jit = [(vma_and_jit_check, ("xla", "jit", "batched")),
               (vma_and_jit_check, ("pallas", "jit", "batched")), (transforms_check, ())]
    # the layers' context_axis: layer_check, and the README example (every run)
    layer = [(layer_check, (4,))] if full else []
    return {"vma": vma, "jit": jit, "context": context + layer + [(empty_check, ())], "hlo": hlo,
            "readme": [(readme_check, ())]}


def main(groups, full):
    checks = plan(full)
    for group in groups:
        for check, args in checks[group]:
            start = time.process_time()
            try:
                check(*args)
                print(f"# {check.__name__}{args}: {time.process_time() - start:.1f} s CPU",
                      flush=True)
            except Exception as e:  # reported, so one failure does not hide the rest
                report(f"{group} {check.__name__}{args} raised {type(e).__name__}: "
                       f"{str(e)[:500]}", 1.0, 0.0)


if __name__ == "__main__":
    main(sys.argv[1:] or ["vma", "jit", "context", "hlo", "readme"],
         os.environ.get("GLA_MULTIDEVICE") == "full")
