"""Gradients of the SPEC inputs from the fp32 buffers a backward launch list writes.

Written with `.reshape` and `.sum(axis)` only, so torch tensors and jax arrays
both pass through. Buffers (batched layout): dq, dk_h, dv_h per query head
[B,T,H,*]; da [B,T,H,K] (gradient of the summed log decay over K), dg_head
[B,T,H] (or partial sums [NK,B,T,H]), db [B,T,H,V], dgamma [N,H], d_initial_state [N,H,K,V].
"""

BUFFERS = ("dq", "dk_h", "dv_h", "da", "dg_head", "db", "dgamma", "d_initial_state")


def _per_kv_head(x, plan):
    """Sum a per-query-head gradient [B,T,H,D] over each kv head's group."""
    if plan.group == 1:
        return x
    B, T, _, D = x.shape
    return x.reshape(B, T, plan.Hk, plan.group, D).sum(3)


def assemble(plan, env) -> dict:
    """{input name: fp32 gradient in that input's batched shape}."""
    out = {"q": env["dq"], "k": _per_kv_head(env["dk_h"], plan),
           "v": _per_kv_head(env["dv_h"], plan)}
    if plan.g == "key":
        out["g"] = env["da"]
    elif plan.g == "head":  # chunk mode gives it per K block: [NK,B,T,H]
        dg = env["dg_head"]
        out["g"] = dg.sum(0) if len(dg.shape) == 4 else dg
    if plan.gk:
        out["gk"] = env["da"]
    if plan.gv:
        out["gv"] = env["db"]
    if plan.g_gamma == "head":
        out["g_gamma"] = env["dgamma"].sum(0)
    elif plan.g_gamma == "seq":
        out["g_gamma"] = env["dgamma"]
    if plan.initial_state:
        out["initial_state"] = env["d_initial_state"]
    return out
