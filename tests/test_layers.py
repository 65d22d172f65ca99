"""GLA / Lightning layers: torch module vs JAX apply vs a float64 NumPy reference built
on parity/oracle.py; decoding with the returned state; left padding; training; weight
transfer; autocast (torch.compile, export and autocast training: test_torch_compile.py).

JAX compiles of the XLA path cost seconds each here, so the JAX side uses a few jitted
functions with fixed shapes, cached at module level."""

import functools

import numpy as np
import pytest
import torch

import bridge.kernels  # noqa: F401  (decides on Triton's interpreter before triton loads)
import jax
import jax.numpy as jnp

from bridge.weights import LayerConfig, load_into_torch, param_shapes, params_from_torch
from jax_side.layers import gla_apply, init_gla, init_lightning, lightning_apply
from parity import oracle
from parity.compare import rel_err
from torch_side.layers import GatedLinearAttention, LightningAttention

jax.config.update("jax_enable_x64", False)

GLA = LayerConfig(hidden_size=16, num_heads=2, num_kv_heads=1, expand_k=1.0, expand_v=1.0,
                  gate_low_rank_dim=4, gate_logit_normalizer=4.0)
LIGHT = LayerConfig(hidden_size=16, num_heads=2, kind="lightning", layer_idx=1, num_layers=3)
B, T = 2, 8


def make_torch(config, seed=0, **kw):
    torch.manual_seed(seed)
    cls = GatedLinearAttention if config.kind == "gla" else LightningAttention
    m = cls(config=config, **kw)
    with torch.no_grad():  # a non-trivial norm weight and gate bias, so both are tested
        m.g_norm.weight.uniform_(0.5, 1.5)
    return m


def np_params(module):
    return {k: v.detach().double().numpy() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------- float64 reference
_sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
REF_FEATURE_MAPS = {  # fla's ACT2FN, written out (gelu: its tanh approximation)
    "relu": lambda x: np.maximum(x, 0), "sigmoid": _sigmoid,
    "logsigmoid": lambda x: -np.logaddexp(0.0, -x), "swish": lambda x: x * _sigmoid(x),
    "silu": lambda x: x * _sigmoid(x), "sqrelu": lambda x: np.maximum(x, 0) ** 2,
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
}


def ref_layer(p, x, c, state=None):
    """The layer in float64 NumPy: projections here, the recurrence from the oracle."""
    H, Hk, K, V = c.num_heads, c.kv_heads, c.head_k_dim, c.head_v_dim
    Bx, Tx, _ = x.shape
    q = (x @ p["q_proj.weight"].T).reshape(Bx, Tx, H, K)
    k = (x @ p["k_proj.weight"].T).reshape(Bx, Tx, Hk, K)
    v = (x @ p["v_proj.weight"].T).reshape(Bx, Tx, Hk, V)
    if c.kind == "gla":
        z = (x @ p["gk_proj.0.weight"].T) @ p["gk_proj.1.weight"].T + p["gk_proj.1.bias"]
        gk = -np.logaddexp(0.0, -z) / c.gate_logit_normalizer  # logsigmoid
        if c.clamp_min is not None:
            gk = np.maximum(gk, c.clamp_min)
        if c.feature_map is not None:
            q, k = REF_FEATURE_MAPS[c.feature_map](q), REF_FEATURE_MAPS[c.feature_map](k)
        gk = np.repeat(gk.reshape(Bx, Tx, Hk, K), H // Hk, axis=2)
        o, S = oracle.recurrent_gla(q, k, v, g=gk, initial_state=state)
    else:
        o, S = oracle.lightning_attn(q, k, v, c.layer_idx, c.num_layers, initial_state=state)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + c.norm_eps) * p[c.norm_param]
    if c.use_output_gate:
        g = (x @ p["g_proj.weight"].T).reshape(Bx, Tx, H, V)
        o = o * g / (1 + np.exp(-g))
    return o.reshape(Bx, Tx, H * V) @ p["o_proj.weight"].T, S


# ---------------------------------------------------------------- JAX functions (cached)
APPLY = {"gla": gla_apply, "lightning": lightning_apply}


@functools.lru_cache(maxsize=None)
def jax_fn(config, name, **static):
    apply = functools.partial(APPLY[config.kind], config=config, **static)
    if name == "fwd":
        return jax.jit(lambda p, x, s=None, m=None: apply(p, x, state=s, attention_mask=m,
                                                          use_cache=True))
    if name == "vjp":  # output and gradients of sum(o * do) w.r.t. params and x
        def f(p, x, do):
            o, pull = jax.vjp(lambda p, x: apply(p, x), p, x)
            return o, pull(do)
        return jax.jit(f)
    raise KeyError(name)


def to_jax(t):
    return jnp.asarray(t.detach().numpy())


# ---------------------------------------------------------------- forward and gradients
@pytest.mark.parametrize("config", [GLA, LIGHT], ids=["gla", "lightning"])
def test_layer_matches_jax_and_oracle(config):
    m = make_torch(config)
    rng = np.random.default_rng(1)
    x64 = rng.standard_normal((B, T, config.hidden_size))
    do64 = rng.standard_normal((B, T, config.hidden_size))
    x = torch.tensor(x64, dtype=torch.float32, requires_grad=True)
    o = m(x)
    o.backward(torch.tensor(do64, dtype=torch.float32))

    p64 = np_params(m)
    o_ref, _ = ref_layer(p64, x64, config)
    assert rel_err(o.detach(), o_ref) < 2e-5

    oj, (gp, gx) = jax_fn(config, "vjp")(params_from_torch(m, copy=True), to_jax(x),
                                         jnp.asarray(do64, jnp.float32))
    assert rel_err(oj, o.detach()) < 2e-5
    assert rel_err(gx, x.grad) < 2e-5
    for name, prm in m.named_parameters():
        assert rel_err(gp[name], prm.grad) < 2e-5, name

    # float64 directional derivatives of sum(o * do) by central differences
    def loss(p, xx):
        return float((ref_layer(p, xx, config)[0] * do64).sum())

    eps = 1e-5
    u = rng.standard_normal(x64.shape)
    fd = (loss(p64, x64 + eps * u) - loss(p64, x64 - eps * u)) / (2 * eps)
    assert abs(fd - float((x.grad.double().numpy() * u).sum())) < 1e-4 * max(1.0, abs(fd))
    for name in [n for n in ("gk_proj.0.weight", "gk_proj.1.bias", "k_proj.weight",
                             "g_norm.weight") if n in p64]:
        w = rng.standard_normal(p64[name].shape)
        plus, minus = dict(p64), dict(p64)
        plus[name], minus[name] = p64[name] + eps * w, p64[name] - eps * w
        fd = (loss(plus, x64) - loss(minus, x64)) / (2 * eps)
        got = float((dict(m.named_parameters())[name].grad.double().numpy() * w).sum())
        assert abs(fd - got) < 1e-4 * max(1.0, abs(fd)), name


@pytest.mark.parametrize("feature_map", sorted(REF_FEATURE_MAPS))
def test_feature_maps_clamp_and_fla_norm_name_match_the_reference(feature_map):
    """fla's layer options (torch layer): q/k feature maps, clamp_min on the log gate and
    fla's fused norm name, against the float64 reference, with left padding."""
    c = LayerConfig(hidden_size=16, num_heads=2, num_kv_heads=1, expand_k=1.0,
                    gate_low_rank_dim=4, gate_logit_normalizer=4.0, clamp_min=-0.2,
                    feature_map=feature_map, fuse_norm=True)
    torch.manual_seed(0)
    m = GatedLinearAttention(config=c)
    assert c.norm_param == "g_norm_swish_gate.weight" and set(m.state_dict()) == set(
        param_shapes(c))
    with torch.no_grad():
        m.g_norm_swish_gate.weight.uniform_(0.5, 1.5)
        m.gk_proj[1].bias.uniform_(-1.0, 1.0)
    seqs, x, mask = _padded_batch(16, [T, 5], seed=16)
    with torch.no_grad():
        o, s = m(x, attention_mask=mask, use_cache=True)
    for i, xi in enumerate(seqs):
        o_ref, s_ref = ref_layer(np_params(m), xi.double().numpy(), c)
        n = xi.shape[1]
        assert rel_err(o[i:i + 1, T - n:], o_ref) < 2e-5 and rel_err(s[i], s_ref[0]) < 2e-5
        assert bool((o[i, :T - n] == 0).all())


# ---------------------------------------------------------------- decoding and padding
def test_torch_decoding_matches_full_call():
    m = make_torch(GLA)
    step = make_torch(GLA, mode="fused_recurrent")
    step.load_state_dict(m.state_dict())
    x = torch.randn(1, T, GLA.hidden_size)  # B*H = 2: the interpreted kernel stays cheap
    with torch.no_grad():
        o_full, s_full = m(x, use_cache=True)
        o_pre, s = m(x[:, :5], use_cache=True)  # prompt: chunked path
        outs = [o_pre]
        for t in range(5, T):  # tokens: fused recurrent kernel
            o_t, s = step(x[:, t:t + 1], state=s, use_cache=True)
            outs.append(o_t)
    assert rel_err(torch.cat(outs, 1), o_full) < 2e-5
    assert rel_err(s, s_full) < 2e-5
    _, s_ref = ref_layer(np_params(m), x.double().numpy(), GLA)
    assert rel_err(s_full, s_ref) < 2e-5


def test_torch_token_steps_without_kv_groups_match_the_reference():
    """H == Hk (the layer repeats no gate heads): one token a step with its state on the
    torch platform, eager without autograd (the op's body called directly), equals the
    float64 reference over the whole sequence, outputs and final state."""
    c = LayerConfig(hidden_size=16, num_heads=2, expand_k=1.0, expand_v=1.0,
                    gate_low_rank_dim=4, gate_logit_normalizer=4.0)
    m = make_torch(c, platform="torch")
    x = torch.randn(B, T, c.hidden_size)
    s, outs = torch.zeros(c.state_shape(B)), []
    with torch.no_grad():
        for t in range(T):
            o_t, s = m(x[:, t:t + 1], state=s, use_cache=True)
            outs.append(o_t)
    o_ref, s_ref = ref_layer(np_params(m), x.double().numpy(), c)
    assert rel_err(torch.cat(outs, 1), o_ref) < 2e-5
    assert rel_err(s, s_ref) < 2e-5


def test_jax_decoding_matches_full_call():
    params = init_gla(jax.random.PRNGKey(3), GLA)
    x = jax.random.normal(jax.random.PRNGKey(4), (B, T, GLA.hidden_size))
    fwd = jax_fn(GLA, "fwd")
    o_full, s_full = fwd(params, x)
    s = jnp.zeros(GLA.state_shape(B))
    outs = []
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8)):
        s_before = s
        o, s = fwd(params, x[:, lo:hi], s)
        outs.append(o)
    assert rel_err(jnp.concatenate(outs, 1), o_full) < 2e-5
    assert rel_err(s, s_full) < 2e-5
    # one step through the Triton kernel (interpreted, host callback) gives the same
    o_k, s_k = jax_fn(GLA, "fwd", platform="triton", mode="fused_recurrent")(
        params, x[:, 7:8], s_before)
    assert rel_err(o_k, outs[-1]) < 2e-5 and rel_err(s_k, s_full) < 2e-5


def _padded_batch(hidden, lens, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(1, n, hidden, generator=g) for n in lens]
    Tm = max(lens)
    x = torch.zeros(len(lens), Tm, hidden)
    mask = torch.zeros(len(lens), Tm, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        x[i, Tm - n:] = s[0] + 0  # left padding; padded rows get junk below
        x[i, :Tm - n] = 7.0 * torch.randn(Tm - n, hidden, generator=g)
        mask[i, Tm - n:] = 1
    return seqs, x, mask


@pytest.mark.parametrize("config", [GLA, LIGHT], ids=["gla", "lightning"])
def test_torch_left_padding_equals_unpadded(config):
    m = make_torch(config)
    seqs, x, mask = _padded_batch(config.hidden_size, [T, 5], seed=5)
    s0 = torch.randn(*config.state_shape(2))  # padding must not decay a carried state
    with torch.no_grad():
        o, s = m(x, attention_mask=mask, state=s0, use_cache=True)
        for i, xi in enumerate(seqs):
            oi, si = m(xi, state=s0[i:i + 1], use_cache=True)
            n = xi.shape[1]
            assert rel_err(o[i, T - n:], oi[0]) < 2e-5
            assert rel_err(s[i], si[0]) < 2e-5
            assert bool((o[i, :T - n] == 0).all())  # padded outputs are zero


def test_torch_cu_seqlens_equals_separate_runs():
    m = make_torch(GLA)
    seqs, _, _ = _padded_batch(GLA.hidden_size, [T, 5], seed=13)
    s0 = torch.randn(*GLA.state_shape(2))
    with torch.no_grad():
        o, s = m(torch.cat(seqs, 1), cu_seqlens=torch.tensor([0, T, T + 5]), state=s0,
                 use_cache=True)
        for i, (lo, hi) in enumerate(((0, T), (T, T + 5))):
            oi, si = m(seqs[i], state=s0[i:i + 1], use_cache=True)
            assert rel_err(o[:, lo:hi], oi) < 2e-5
            assert rel_err(s[i], si[0]) < 2e-5
    with pytest.raises(ValueError, match="attention_mask"):
        m(torch.cat(seqs, 1), cu_seqlens=torch.tensor([0, T, T + 5]),
          attention_mask=torch.ones(1, T + 5))


def test_jax_left_padding_equals_unpadded():
    params = init_gla(jax.random.PRNGKey(6), GLA)
    seqs, x, mask = _padded_batch(GLA.hidden_size, [T, 5], seed=7)
    fwd = jax_fn(GLA, "fwd")
    o, s = fwd(params, to_jax(x), None, jnp.asarray(mask.numpy()))
    for i, xi in enumerate(seqs):
        oi, si = fwd(params, to_jax(xi))
        n = xi.shape[1]
        assert rel_err(o[i, T - n:], oi[0]) < 2e-5
        assert rel_err(s[i], si[0]) < 2e-5


# ---------------------------------------------------------------- training
def _copy_task(seed):
    """Toy copy task: the target at step t is the input at step t-1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 12, GLA.hidden_size)).astype(np.float32)
    y = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], 1)
    return x, y


def test_torch_training_decreases_loss():
    m = make_torch(GLA)
    x, y = (torch.from_numpy(a) for a in _copy_task(8))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_jax_training_decreases_loss():
    params = init_gla(jax.random.PRNGKey(9), GLA)
    x, y = (jnp.asarray(a) for a in _copy_task(8))

    @jax.jit
    def adam_step(p, m1, m2, i):
        loss, g = jax.value_and_grad(lambda p: ((gla_apply(p, x, GLA) - y) ** 2).mean())(p)
        m1 = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m1, g)
        m2 = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, m2, g)
        c1, c2 = 1 - 0.9 ** i, 1 - 0.999 ** i
        p = jax.tree.map(lambda w, a, b: w - 1e-2 * (a / c1) / (jnp.sqrt(b / c2) + 1e-8),
                         p, m1, m2)
        return p, m1, m2, loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    m1, m2, losses = zeros, zeros, []
    for i in range(1, 16):
        params, m1, m2, loss = adam_step(params, m1, m2, float(i))
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses


# ---------------------------------------------------------------- weights
def test_weight_round_trip_is_exact_and_zero_copy():
    m = make_torch(GLA)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    p = params_from_torch(m)
    assert p["q_proj.weight"].unsafe_buffer_pointer() == m.q_proj.weight.data_ptr()
    assert set(p) == set(param_shapes(GLA))
    other = make_torch(GLA, seed=11)
    load_into_torch(other, p)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), k
    # and jax -> torch from parameters created in JAX
    pj = init_gla(jax.random.PRNGKey(12), GLA)
    load_into_torch(other, pj)
    for k, v in params_from_torch(other, copy=True).items():
        assert np.array_equal(np.asarray(v), np.asarray(pj[k])), k


def test_mismatched_weights_raise():
    m = make_torch(GLA)
    p = params_from_torch(m, copy=True)
    wider = LayerConfig(hidden_size=16, num_heads=2, expand_k=1.0, gate_low_rank_dim=4,
                        gate_logit_normalizer=4.0)  # GLA with num_kv_heads=2
    with pytest.raises(ValueError, match="k_proj.weight"):
        load_into_torch(make_torch(wider), p)
    with pytest.raises(ValueError, match="config"):
        load_into_torch(m, p, config=wider)
    with pytest.raises(ValueError, match="missing"):
        load_into_torch(make_torch(LIGHT), init_gla(jax.random.PRNGKey(0), GLA))
    bad = dict(p, **{"o_proj.weight": jnp.zeros((16, 8))})
    with pytest.raises(ValueError, match="o_proj.weight"):
        gla_apply(bad, jnp.zeros((1, 2, 16)), GLA)
    with pytest.raises(ValueError, match="config"):
        params_from_torch(m, config=wider)
    with pytest.raises(ValueError, match="num_kv_heads"):
        LayerConfig(hidden_size=16, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="attention_mask"):
        m(torch.zeros(2, 4, 16), attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="x"):
        m(torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match="initial_state"):  # the op checks N
        m(torch.zeros(2, 4, 16), state=torch.zeros(GLA.state_shape(3)))
    with pytest.raises(ValueError, match="state"):
        m(torch.zeros(2, 4, 16), state=torch.zeros(2, 2, 8, 9))
    with pytest.raises(ValueError, match="state"):
        gla_apply(p, jnp.zeros((2, 4, 16)), GLA, state=jnp.zeros((2, 2, 9, 8)))


@pytest.mark.parametrize("bad", [
    dict(x=(2, 4, 8)), dict(x=(4, 16)),
    dict(attention_mask=(2, 5)), dict(attention_mask=(2, 4), cu_seqlens=True),
    dict(state=(2, 2, 8, 9)), dict(state=(2, 8, 8)),
])
def test_layers_reject_bad_inputs_alike(bad):
    """One check (bridge.weights.check_inputs) for both frameworks' layers: the same
    ValueError text for the same bad input, before any projection runs."""
    m = make_torch(GLA)
    p = params_from_torch(m, copy=True)
    shape = lambda n, d=None: bad.get(n, d)  # noqa: E731
    x = shape("x", (2, 4, 16))
    mask, state = shape("attention_mask"), shape("state")
    cu = [0, 8] if bad.get("cu_seqlens") else None
    with pytest.raises(ValueError) as t:
        m(torch.zeros(x), attention_mask=None if mask is None else torch.ones(mask),
          cu_seqlens=None if cu is None else torch.tensor(cu),
          state=None if state is None else torch.zeros(state))
    with pytest.raises(ValueError) as j:
        gla_apply(p, jnp.zeros(x), GLA, attention_mask=None if mask is None else jnp.ones(mask),
                  cu_seqlens=None if cu is None else jnp.array(cu),
                  state=None if state is None else jnp.zeros(state))
    assert str(t.value) == str(j.value)
    assert str(t.value).split(":")[0] == next(iter(bad))
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        m(np.zeros((2, 4, 16), np.float32))


# ---------------------------------------------------------------- autocast
def test_autocast_bf16_is_close():
    m = make_torch(GLA)
    x = torch.randn(B, T, GLA.hidden_size)
    with torch.no_grad():
        ref, s_ref = m(x, use_cache=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, s = m(x, use_cache=True)
    assert got.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert rel_err(got.float(), ref) < 3e-2
    assert rel_err(s, s_ref) < 3e-2


def test_jax_lightning_with_padding_matches_torch():
    """init_lightning in JAX, the same weights loaded into torch: the masked path (a
    per-step decay zeroed at padding) agrees across frameworks and with unpadded runs."""
    params = init_lightning(jax.random.PRNGKey(14), LIGHT)
    m = make_torch(LIGHT)
    load_into_torch(m, params)
    seqs, x, mask = _padded_batch(LIGHT.hidden_size, [T, 5], seed=15)
    s0 = torch.randn(*LIGHT.state_shape(2))
    with torch.no_grad():
        o_t, s_t = m(x, attention_mask=mask, state=s0, use_cache=True)
        o_5, s_5 = m(seqs[1], state=s0[1:], use_cache=True)
    o_j, s_j = jax_fn(LIGHT, "fwd")(params, to_jax(x), to_jax(s0), jnp.asarray(mask.numpy()))
    assert rel_err(o_j, o_t) < 2e-5 and rel_err(s_j, s_t) < 2e-5
    assert rel_err(o_j[1, T - 5:], o_5[0]) < 2e-5 and rel_err(s_j[1], s_5[0]) < 2e-5
