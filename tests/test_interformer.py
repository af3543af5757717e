"""Gating, PFFN and InterFormerBlock against float64 NumPy references; jagged invariance."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.layers.interformer import PFFN, Gating, InterFormerBlock, interformer_flops
from test_attention import (D, H, inputs, np_, randomize_params, ref_attention, ref_layernorm,
                            ref_pma, scramble_padding)
from test_sequence import ref_gelu, ref_ln

N_X = 5  # non-sequence tokens
N_S = 4 + 2 + 2  # default CLS + PMA + recent summary tokens


class TokenMixer(nnx.Module):
  """A small interaction module for the tests: y = (tanh(W_t^T Z W_d)) mapped to n_out tokens."""

  def __init__(self, n_in: int, n_out: int, rngs: nnx.Rngs):
    self.w_t = nnx.Param(jax.random.normal(rngs.params(), (n_in, n_out)) / np.sqrt(n_in))
    self.w_d = nnx.Param(jax.random.normal(rngs.params(), (D, D)) / np.sqrt(D))

  def __call__(self, z):
    y = jnp.einsum("bnd,nm->bmd", z, self.w_t[...].astype(z.dtype))  # (B, n_out, D)
    return jnp.tanh(y @ self.w_d[...].astype(z.dtype))


def ref_mixer(m, z):
  return np.tanh(np.einsum("bnd,nm->bmd", z, np_(m.w_t)) @ np_(m.w_d))


def ref_gating(g, x):
  m = ref_gelu(x @ np_(g.fc1.kernel) + np_(g.fc1.bias)) @ np_(g.fc2.kernel) + np_(g.fc2.bias)
  return x / (1.0 + np.exp(-x * m))


def ref_pffn(p, x_sum, s):
  k, v = x_sum @ np_(p.w_k.kernel), x_sum @ np_(p.w_v.kernel)
  h = ref_gelu(np.einsum("bld,bmd->blm", ref_ln(p.norm, s), k) / np.sqrt(s.shape[-1]))
  return s + h @ v


def ref_block(blk, x, s, valid, dt):
  """Float64 reference of InterFormerBlock (equations of gem_jax.layers.interformer)."""
  x, s = np.asarray(x, np.float64), np.asarray(s, np.float64)
  valid, dt = np.asarray(valid), np.asarray(dt, np.float64)
  b, n = s.shape[:2]
  z = np.einsum("bnd,nm->bmd", x, np_(blk.x_mix))
  z = ref_gelu(z @ np_(blk.x_fc1.kernel) + np_(blk.x_fc1.bias))
  x_sum = ref_gating(blk.x_gate, z @ np_(blk.x_fc2.kernel) + np_(blk.x_fc2.bias))
  u = ref_pffn(blk.pffn, x_sum, s)
  u = np.concatenate([np.broadcast_to(np_(blk.cls), (b, 4, D)), u], 1)
  v_ext = np.concatenate([np.ones((b, 4), bool), valid], 1)
  dt_ext = np.concatenate([np.zeros((b, 4)), dt], 1)
  u = u + ref_attention(blk.attn, ref_ln(blk.attn_norm, u), v_ext, dt_ext, mask="causal")
  s_cls, s_new = u[:, :4], u[:, 4:]
  rec = np.where(valid[:, :2, None], s_new[:, :2], 0.0)
  summ = ref_ln(blk.s_norm, np.concatenate([s_cls, ref_pma(blk.pma, s_new, valid), rec], 1))
  summ[:, 6:] = np.where(valid[:, :2, None], summ[:, 6:], 0.0)
  s_sum = ref_gating(blk.s_gate, summ)
  x_new = ref_mixer(blk.interaction, np.concatenate([x, s_sum], 1))[:, :N_X]
  return x_new, s_new, x_sum, s_sum


def _inputs(seed=0):
  s, valid, dt = inputs(seed=seed)
  x = jax.random.normal(jax.random.key(seed + 100), (s.shape[0], N_X, D))
  return x, s, valid, dt


def _block(n_out=N_X + N_S, seed=0, **kw):
  mixer = TokenMixer(N_X + N_S, n_out, nnx.Rngs(seed + 1))
  kw = dict(dict(mask="causal", rope=True, time_buckets=10), **kw)
  return InterFormerBlock(D, N_X, H, interaction=mixer, rngs=nnx.Rngs(seed), **kw)


def test_gating_matches_reference():
  g = randomize_params(Gating(D, hidden=8, rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(1), (2, 3, D))
  y = g(x)
  assert y.shape == x.shape
  np.testing.assert_allclose(np.asarray(y), ref_gating(g, np.asarray(x, np.float64)),
                             rtol=1e-5, atol=1e-6)
  assert Gating(D, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x).dtype == jnp.bfloat16


def test_pffn_matches_reference():
  p = randomize_params(PFFN(D, 3, rngs=nnx.Rngs(0)))
  x_sum = jax.random.normal(jax.random.key(1), (2, 3, D))
  s = jax.random.normal(jax.random.key(2), (2, 7, D))
  y = p(x_sum, s)
  assert y.shape == s.shape
  np.testing.assert_allclose(np.asarray(y), ref_pffn(p, np.asarray(x_sum, np.float64),
                                                     np.asarray(s, np.float64)),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="tokens"):
    p(x_sum[:, :2], s)


@pytest.fixture(scope="module")
def block_and_fn():
  """The block with random parameters, called through a plain jax.jit (no nnx transform)."""
  blk = randomize_params(_block())
  graphdef, state = nnx.split(blk)

  @jax.jit
  def fn(state, x, s, valid, dt):
    return nnx.merge(graphdef, state)(x, s, valid, dt)

  return blk, lambda *a: fn(state, *a)


def test_interformer_matches_reference(block_and_fn):
  blk, fn = block_and_fn
  x, s, valid, dt = _inputs()
  out = fn(x, s, valid, dt)
  assert [o.shape for o in out] == [(3, N_X, D), (3, 10, D), (3, 4, D), (3, N_S, D)]
  refs = ref_block(blk, x, s, valid, dt)
  v = np.asarray(valid)
  for i, (got, ref) in enumerate(zip(out, refs)):
    got = np.asarray(got)
    if i == 1:  # s': only valid events are defined
      got, ref = got[v], ref[v]
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5, err_msg=f"output {i}")


def test_interformer_padding_invariance(block_and_fn):
  _, fn = block_and_fn
  x, s, valid, dt = _inputs()
  out = fn(x, s, valid, dt)
  s2, dt2 = scramble_padding(valid, s, dt)
  out2 = fn(x, s2, valid, dt2)
  v = np.asarray(valid)
  for i, (a, b) in enumerate(zip(out, out2)):
    a, b = np.asarray(a), np.asarray(b)
    if i == 1:
      a, b = a[v], b[v]
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6, err_msg=f"output {i}")


def test_interformer_bf16_grads_and_n_token_interaction():
  """bf16 compute / fp32 params, finite grads, an interaction that returns n tokens, remat."""
  blk = _block(n_out=N_X, seed=3, score="silu", mask="block_local", block_size=4,
               dtype=jnp.bfloat16, remat="dots")
  x, s, valid, dt = _inputs(seed=1)

  def loss(m, x, s):
    outs = m(x, s, valid, dt)
    return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in outs), outs

  (_, outs), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(blk, x, s)
  assert [o.shape for o in outs] == [(3, N_X, D), (3, 10, D), (3, 4, D), (3, N_S, D)]
  assert all(o.dtype == jnp.bfloat16 for o in outs)
  leaves = jax.tree.leaves(grads)
  assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all()) for g in leaves)
  for g in (grads.cls, grads.x_mix, grads.pma.seeds, grads.attn.time_bias, grads.pffn.w_k.kernel,
            grads.interaction.w_t):
    assert float(jnp.abs(g[...]).sum()) > 0
  assert blk.x_fc1.kernel.get_metadata()["logical_axes"] == ("embed", "mlp")


def test_interformer_rejects_bad_interaction():
  blk = _block(n_out=3)
  x, s, valid, dt = _inputs()
  graphdef, state = nnx.split(blk)
  with pytest.raises(ValueError, match="interaction returned 3 tokens"):
    jax.eval_shape(lambda st: nnx.merge(graphdef, st)(x, s, valid, dt), state)
  with pytest.raises(ValueError, match="needs dt"):
    blk(x, s, valid)


class Identity(nnx.Module):
  def __call__(self, z):
    return z


def test_interformer_flops_match_xla():
  """interformer_flops (interaction excluded: identity here) within 10% of XLA's count."""
  n, L, d = 8, 64, 128
  blk = InterFormerBlock(d, n, 2, interaction=Identity(), qk_norm=False, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(blk)
  x, s, valid = jnp.zeros((1, n, d)), jnp.zeros((1, L, d)), jnp.ones((1, L), bool)
  compiled = jax.jit(lambda st, x, s: nnx.merge(graphdef, st)(x, s, valid)).lower(
      state, x, s).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  want = interformer_flops(n, L, d)
  assert abs(cost["flops"] / want - 1) < 0.10, (cost["flops"], want)
