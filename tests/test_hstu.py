"""The HSTU layer against a float64 NumPy reference; chunked == dense; padding; packing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import references as R
from gem_jax.layers.attention import AttentionImpl
from gem_jax.layers.hstu import HSTU, hstu_flops

B, L, D, H = 3, 21, 16, 2
LENGTHS = (15, 21, 0)


def ref_hstu(p, x, valid, dt, *, heads, mask="causal", block=64, recent_first=True,
             scale=1.0, norm=None, seg=None, pos=None):
  """y = x + W_2(LN(A V) * U), A = silu(scale Q K^T + rab) / N on allowed keys (float64)."""
  x, valid = np.asarray(x, np.float64), np.asarray(valid)
  b, n, d = x.shape
  dh = d // heads
  h = R.ACT["silu"](R.dense(p["uvqk"], R.ln(p["in_norm"], x)))  # (B, L, 4D)
  u, v, q, k = (t.reshape(b, n, heads, dh) for t in np.split(h, 4, axis=-1))
  s = scale * np.einsum("bqhd,bkhd->bhqk", q, k)  # (B, H, L, L)
  if "time_bias" in p:
    dtn = np.asarray(dt, np.float64)
    idx = R.bucket(dtn[:, :, None] - dtn[:, None, :], p["time_bias"].shape[0])  # (B, L, L)
    s = s + np.moveaxis(p["time_bias"][idx], -1, 1)
  if "pos_bias" in p:
    pn = np.broadcast_to(np.arange(n), (b, n)) if pos is None else np.asarray(pos)
    idx = np.minimum(np.abs(pn[:, :, None] - pn[:, None, :]), p["pos_bias"].shape[0] - 1)
    s = s + np.moveaxis(p["pos_bias"][idx], -1, 1)
  allowed = R.allowed_mask(valid, mask, block, recent_first)  # (B, L, L)
  if seg is not None:
    sg = np.asarray(seg)
    allowed = allowed & (sg[:, :, None] == sg[:, None, :])
  norm = norm or (block if mask == "block_local" else n)
  a = np.where(allowed[:, None], R.ACT["silu"](s), 0.0) / norm  # (B, H, L, L)
  o = np.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, n, d)
  y = R.dense(p["out"], R.ln(p["out_norm"], o) * u.reshape(b, n, d))
  return x + np.where(valid[:, :, None], y, 0.0)


def randomize(m, seed=0):
  keys = iter(jax.random.split(jax.random.key(seed), 100))
  state = nnx.state(m, nnx.Param)
  nnx.update(m, jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape), state))
  return m


def inputs(seed=0, lengths=LENGTHS, n=L):
  kx, kd = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (len(lengths), n, D))
  valid = jnp.arange(n)[None, :] < jnp.asarray(lengths)[:, None]
  dt = jnp.cumsum(jnp.exp(4.0 * jax.random.uniform(kd, (len(lengths), n))), axis=1)
  return x, valid, dt


@pytest.mark.parametrize("mask,recent_first", [("causal", True), ("causal", False),
                                               ("full", True), ("block_local", True)])
def test_hstu_matches_reference(mask, recent_first):
  m = randomize(HSTU(D, H, mask=mask, block_size=8, recent_first=recent_first,
                     time_buckets=10, pos_buckets=12, scale=0.5, rngs=nnx.Rngs(0)))
  x, valid, dt = inputs()
  y = m(x, valid, dt)
  ref = ref_hstu(R.params(m), x, valid, dt, heads=H, mask=mask, block=8,
                 recent_first=recent_first, scale=0.5)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(y[2]), np.asarray(x[2]))  # empty row: y = x


def test_hstu_chunked_equals_dense_with_grads():
  kw = dict(mask="causal", time_buckets=10, pos_buckets=12, norm_len=32, rngs=nnx.Rngs(1))
  md = randomize(HSTU(D, H, impl=AttentionImpl("dense"), **kw), seed=2)
  mc = HSTU(D, H, impl=AttentionImpl("chunked", chunk_size=8), **kw)
  nnx.update(mc, nnx.state(md, nnx.Param))
  x, valid, dt = inputs(seed=3)

  def loss(m, x):
    return jnp.sum(jnp.sin(m(x, valid, dt)))

  ld, gd = nnx.value_and_grad(loss, argnums=(0, 1))(md, x)
  lc, gc = nnx.value_and_grad(loss, argnums=(0, 1))(mc, x)
  np.testing.assert_allclose(float(lc), float(ld), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gd)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(gc[0].pos_bias[...]).sum()) > 0


def test_hstu_padding_invariance():
  m = randomize(HSTU(D, H, time_buckets=10, pos_buckets=12,
                     impl=AttentionImpl("chunked", chunk_size=8), rngs=nnx.Rngs(4)))
  x, valid, dt = inputs(seed=5)
  y = m(x, valid, dt)
  x2 = jnp.where(valid[:, :, None], x, 100.0 * jax.random.normal(jax.random.key(6), x.shape))
  dt2 = jnp.where(valid, dt, 1e9)
  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(m(x2, valid, dt2))[v], np.asarray(y)[v], atol=1e-6)


def test_hstu_packed_matches_reference_and_separate_rows():
  """Two histories packed in one row (segment ids, in-segment positions, N = max length)
  give the reference and the outputs of each history in its own padded row."""
  m = randomize(HSTU(D, H, time_buckets=10, pos_buckets=12, norm_len=16, rngs=nnx.Rngs(7)))
  x, _, dt = inputs(seed=8, lengths=(L,))
  n1 = 9
  seg = (jnp.arange(L) >= n1).astype(jnp.int32)[None]
  pos = jnp.where(seg == 0, jnp.arange(L), jnp.arange(L) - n1)
  valid = jnp.ones((1, L), bool)
  y = m(x, valid, dt, seg=seg, pos=pos)
  ref = ref_hstu(R.params(m), x, valid, dt, heads=H, norm=16, seg=seg, pos=pos)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
  for sl in (slice(0, n1), slice(n1, L)):
    alone = m(x[:, sl], valid[:, sl], dt[:, sl])
    np.testing.assert_allclose(np.asarray(y[:, sl]), np.asarray(alone), rtol=1e-5, atol=1e-5)


def test_hstu_bf16_and_flops():
  m = HSTU(D, H, time_buckets=4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x, valid, dt = inputs()
  y = m(x, valid, dt)
  assert y.dtype == jnp.bfloat16 and y.shape == (B, L, D)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
  n, d = 256, 128
  m = HSTU(d, 2, mask="full", impl=AttentionImpl("dense"), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(m)
  cost = jax.jit(lambda s, x, v: nnx.merge(graphdef, s)(x, v)).lower(
      state, jnp.zeros((1, n, d)), jnp.ones((1, n), bool)).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert abs(cost["flops"] / hstu_flops(n, d, mask="full") - 1) < 0.10
