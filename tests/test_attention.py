"""Attention, CrossAttention and PMA against a float64 NumPy reference; jagged masks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import references as R
from gem_jax.layers.attention import (PMA, Attention, CrossAttention, attention_flops,
                                      time_bucket)

B, L, D, H = 3, 10, 16, 4
LENGTHS = (7, 10, 0)  # the last row has no valid event


# ----------------------------------------------------------------------------- reference
# The float64 references live in tests/references.py (shared with the GEM forward test);
# these wrappers read a module's switches and hand its parameter arrays over.
def np_(p):
  return np.asarray(p[...], np.float64)


ref_layernorm = R.layernorm


def ref_attention(m, x, valid, dt=None, *, mask="full", block=64, recent_first=True):
  """Float64 reference of `Attention` with the module's own parameters."""
  return R.attention(R.params(m), x, valid, dt, heads=m.num_heads, score=m.score, mask=mask,
                     block=block, rope_on=m.rope, recent_first=recent_first)


def ref_cross(m, q_in, kv, kv_valid, kv_dt=None):
  return R.cross_attention(R.params(m), q_in, kv, kv_valid, kv_dt, heads=m.num_heads,
                           score=m.score)


def ref_pma(m, x, valid):
  return R.pma(R.params(m), x, valid, heads=m.attn.num_heads, score=m.attn.score)


# ----------------------------------------------------------------------------- helpers
def randomize_params(module, seed=0):
  """Add N(0, 0.3^2) noise to every parameter (so zero-init biases and tables matter)."""
  keys = iter(jax.random.split(jax.random.key(seed), 1000))
  state = nnx.state(module, nnx.Param)
  new = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape, p.dtype), state)
  nnx.update(module, new)
  return module


def inputs(seed=0, n=L, lengths=LENGTHS):
  kx, kd = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (len(lengths), n, D), jnp.float32)
  valid = jnp.arange(n)[None, :] < jnp.asarray(lengths)[:, None]  # (B, L)
  dt = jnp.cumsum(jnp.exp(4.0 * jax.random.uniform(kd, (len(lengths), n))), axis=1)  # (B, L)
  return x, valid, dt


def scramble_padding(valid, *arrays, seed=1):
  """Random values at the padded positions of each (B, L, ...) array."""
  out = []
  for i, a in enumerate(arrays):
    noise = 100.0 * jax.random.normal(jax.random.key(seed + i), a.shape, a.dtype)
    m = valid.reshape(valid.shape + (1,) * (a.ndim - 2))
    out.append(jnp.where(m, a, noise))
  return out


CASES = [(s, m) for s in ("softmax", "silu") for m in ("full", "causal", "block_local")]


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("score,mask", CASES)
def test_attention_matches_reference(score, mask):
  m = randomize_params(Attention(D, H, score=score, mask=mask, block_size=4, rope=True,
                                 time_buckets=12, rngs=nnx.Rngs(0)))
  x, valid, dt = inputs()
  y = m(x, valid, dt)
  ref = ref_attention(m, x, valid, dt, mask=mask, block=4)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
  # The empty row gives exactly the output bias.
  np.testing.assert_array_equal(np.asarray(y[2]), np.broadcast_to(np.asarray(m.out.bias[...]),
                                                                  (L, D)))


@pytest.mark.parametrize("rope,time_buckets,qk_norm", [(False, 0, False), (False, 6, True),
                                                       (True, 0, True)])
def test_attention_options_match_reference(rope, time_buckets, qk_norm):
  m = randomize_params(Attention(D, H, rope=rope, time_buckets=time_buckets, qk_norm=qk_norm,
                                 rngs=nnx.Rngs(1)), seed=3)
  x, valid, dt = inputs(seed=2)
  y = m(x, valid, dt if time_buckets else None)
  np.testing.assert_allclose(np.asarray(y), ref_attention(m, x, valid, dt), rtol=1e-5,
                             atol=1e-5)


def test_chronological_causal_matches_reference():
  m = randomize_params(Attention(D, H, mask="causal", recent_first=False, rngs=nnx.Rngs(2)))
  x, _, _ = inputs(seed=4)
  valid = jnp.ones((B, L), bool)
  np.testing.assert_allclose(np.asarray(m(x, valid)),
                             ref_attention(m, x, valid, mask="causal", recent_first=False),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score,mask", CASES)
def test_attention_padding_invariance(score, mask):
  m = randomize_params(Attention(D, H, score=score, mask=mask, block_size=4, rope=True,
                                 time_buckets=12, rngs=nnx.Rngs(0)))
  x, valid, dt = inputs()
  f = jax.jit(lambda x, dt: m(x, valid, dt))
  y = f(x, dt)
  x2, dt2 = scramble_padding(valid, x, dt)
  assert not np.allclose(np.asarray(x2), np.asarray(x))
  y2 = f(x2, dt2)
  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(y2)[v], np.asarray(y)[v], rtol=0, atol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "silu"])
def test_block_local_unaligned_length_matches_reference(score):
  """Block-local == the reference with the block mask also when L % b != 0 (L=10, b=4)."""
  m = randomize_params(Attention(D, H, score=score, mask="block_local", block_size=4,
                                 rngs=nnx.Rngs(5)))
  x, valid, _ = inputs(seed=6, lengths=(10, 9, 3))
  np.testing.assert_allclose(np.asarray(m(x, valid)),
                             ref_attention(m, x, valid, mask="block_local", block=4),
                             rtol=1e-5, atol=1e-5)


def _shapes_in(jaxpr):
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield tuple(getattr(v.aval, "shape", ()))
    for p in eqn.params.values():
      subs = p if isinstance(p, (list, tuple)) else [p]
      for sub in subs:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _shapes_in(inner)


@pytest.mark.parametrize("mask,expect_square", [("block_local", False), ("full", True)])
def test_block_local_never_builds_full_score_matrix(mask, expect_square):
  n = 256
  m = Attention(D, H, mask=mask, block_size=64, time_buckets=8, rngs=nnx.Rngs(0))
  x = jnp.zeros((2, n, D))
  jaxpr = jax.make_jaxpr(lambda x: m(x, jnp.ones((2, n), bool), jnp.zeros((2, n))))(x)
  square = any(len(s) >= 2 and s[-1] == n and s[-2] == n for s in _shapes_in(jaxpr.jaxpr))
  assert square == expect_square
  if mask == "block_local":
    assert any(s[-2:] == (64, 64) for s in _shapes_in(jaxpr.jaxpr))


@pytest.mark.parametrize("score,mask", CASES)
def test_attention_grads_finite(score, mask):
  m = Attention(D, H, score=score, mask=mask, block_size=4, rope=True, time_buckets=8,
                rngs=nnx.Rngs(0))
  x, valid, dt = inputs()

  def loss(m, x):
    return jnp.sum(m(x, valid, dt) ** 2)

  gm, gx = nnx.grad(loss, argnums=(0, 1))(m, x)
  leaves = jax.tree.leaves(gm) + [gx]
  assert all(bool(jnp.isfinite(g).all()) for g in leaves)
  assert float(jnp.abs(gm.qkv.kernel[...]).sum()) > 0
  assert float(jnp.abs(gm.time_bias[...]).sum()) > 0
  assert float(jnp.abs(gx[2]).sum()) == 0.0  # the empty row cannot influence the loss


def test_attention_bf16_compute_fp32_params():
  m32 = randomize_params(Attention(D, H, rope=True, time_buckets=8, rngs=nnx.Rngs(0)))
  m16 = Attention(D, H, rope=True, time_buckets=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  nnx.update(m16, nnx.state(m32, nnx.Param))
  x, valid, dt = inputs()
  y16 = m16(x, valid, dt)
  assert y16.dtype == jnp.bfloat16 and y16.shape == (B, L, D)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(m16, nnx.Param)))
  y32 = np.asarray(m32(x, valid, dt))
  err = np.abs(np.asarray(y16, np.float32) - y32).max() / np.abs(y32).max()
  assert err < 3e-2, err


def test_logical_axes_on_params():
  m = Attention(D, H, time_buckets=4, rngs=nnx.Rngs(0))
  assert m.qkv.kernel.get_metadata()["logical_axes"] == ("embed", "heads")
  assert m.out.kernel.get_metadata()["logical_axes"] == ("heads", "embed")
  assert m.time_bias.get_metadata()["logical_axes"] == (None, "heads")
  assert m.q_norm.scale.get_metadata()["logical_axes"] == ("norm",)


@pytest.mark.parametrize("score", ["softmax", "silu"])
def test_cross_attention_matches_reference_and_padding(score):
  m = randomize_params(CrossAttention(D, H, score=score, time_buckets=12, rngs=nnx.Rngs(3)))
  x, valid, dt = inputs(seed=7)
  q = jax.random.normal(jax.random.key(9), (B, 2, D))
  y = m(q, x, valid, dt)
  assert y.shape == (B, 2, D)
  np.testing.assert_allclose(np.asarray(y), ref_cross(m, q, x, valid, dt), rtol=1e-5, atol=1e-5)
  x2, dt2 = scramble_padding(valid, x, dt)
  np.testing.assert_allclose(np.asarray(m(q, x2, valid, dt2)), np.asarray(y), rtol=0, atol=1e-6)


def test_pma_matches_reference_and_padding():
  m = randomize_params(PMA(D, 3, H, rngs=nnx.Rngs(4)))
  x, valid, _ = inputs(seed=8)
  y = m(x, valid)
  assert y.shape == (B, 3, D) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), ref_pma(m, x, valid), rtol=1e-5, atol=1e-5)
  (x2,) = scramble_padding(valid, x)
  np.testing.assert_allclose(np.asarray(m(x2, valid)), np.asarray(y), rtol=0, atol=1e-6)
  m16 = PMA(D, 3, H, dtype=jnp.bfloat16, rngs=nnx.Rngs(4))
  assert m16(x, valid).dtype == jnp.bfloat16


def test_time_bucket_edges():
  got = time_bucket(jnp.array([0.0, 0.5, 1.0, 2.9, 3.0, -3.0, 1e9]), 8)
  np.testing.assert_array_equal(np.asarray(got), [0, 0, 1, 1, 2, 2, 7])


@pytest.mark.parametrize("mask", ["full", "block_local"])
def test_attention_flops_match_xla(mask):
  """attention_flops within 10% of XLA's count (matmuls dominate at D=128, H=2)."""
  n, d = 256, 128
  m = Attention(d, 2, mask=mask, block_size=64, qk_norm=False, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(m)

  def f(state, x, valid):
    return nnx.merge(graphdef, state)(x, valid)

  x = jnp.zeros((1, n, d))
  cost = jax.jit(f).lower(state, x, jnp.ones((1, n), bool)).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  want = attention_flops(n, d, mask=mask, block_size=64)
  assert abs(cost["flops"] / want - 1) < 0.10, (cost["flops"], want)


def test_backward_of_the_fused_projections_writes_no_padded_copies():
  """q, k, v leave the fused projection by a split: its transpose is one concatenate;
  indexing would transpose to a pad of the whole (B, L, 3, H, dh) cotangent per slice."""
  x, _, _ = inputs(seed=5)
  valid = jnp.ones((B, L), bool)
  self_attn = Attention(D, H, rngs=nnx.Rngs(0))
  cross = CrossAttention(D, H, rngs=nnx.Rngs(1))
  q = x[:, :2] * 0.5  # cross attention's queries: not a slice of the differentiated x
  cases = [(self_attn, lambda m, x: m(x, valid)), (cross, lambda m, x: m(q, x, valid))]
  for m, fn in cases:
    graphdef, params = nnx.split(m)
    loss = lambda p, x: jnp.sum(fn(nnx.merge(graphdef, p), x))  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))
    assert " pad[" not in jaxpr and "concatenate" in jaxpr, type(m).__name__
