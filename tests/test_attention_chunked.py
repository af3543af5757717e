"""Chunked (flash-style) attention == the dense path, forward and gradients; memory linear in L;
the dispatch between dense, chunked and jax.nn.dot_product_attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.layers.attention import (Attention, AttentionImpl, CrossAttention,
                                      multihead_attention, sdpa_applies, select_impl)

B, L, H, DH = 3, 37, 2, 8
LENGTHS = (30, 37, 0)  # unaligned to the chunk, one full row, one empty row
DENSE = AttentionImpl("dense")
CHUNKED = AttentionImpl("chunked", chunk_size=8)


def heads(seed=0, lq=L, lk=L, lengths=LENGTHS):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (len(lengths), lq, H, DH))
  k = jax.random.normal(ks[1], (len(lengths), lk, H, DH))
  v = jax.random.normal(ks[2], (len(lengths), lk, H, DH))
  valid = jnp.arange(lk)[None, :] < jnp.asarray(lengths)[:, None]  # (B, Lk)
  dt = jnp.cumsum(jnp.exp(4.0 * jax.random.uniform(ks[3], (len(lengths), lk))), axis=1)
  ttab = 0.5 * jax.random.normal(ks[4], (12, H))
  ptab = 0.5 * jax.random.normal(ks[5], (16, H))
  return q, k, v, valid, dt, ttab, ptab


def run(impl, q, k, v, valid, dt, ttab, ptab, **kw):
  return multihead_attention(q, k, v, valid, time_table=ttab, dt_q=dt if kw.pop("self", True)
                             else None, dt_k=dt, pos_table=ptab, impl=impl, **kw)


CASES = [(s, m, r) for s in ("softmax", "silu") for m, r in (("full", True), ("causal", True),
                                                            ("causal", False))]


@pytest.mark.parametrize("score,mask,recent_first", CASES)
def test_chunked_forward_and_grads_match_dense(score, mask, recent_first):
  q, k, v, valid, dt, ttab, ptab = heads()
  kw = dict(score=score, mask=mask, recent_first=recent_first)

  def loss(impl, q, k, v, ttab, ptab):
    o = run(impl, q, k, v, valid, dt, ttab, ptab, **kw)
    return jnp.sum(jnp.sin(o) * o), o

  (ld, od), gd = jax.value_and_grad(lambda *a: loss(DENSE, *a), argnums=range(5),
                                    has_aux=True)(q, k, v, ttab, ptab)
  (lc, oc), gc = jax.jit(jax.value_and_grad(lambda *a: loss(CHUNKED, *a), argnums=range(5),
                                            has_aux=True))(q, k, v, ttab, ptab)
  np.testing.assert_allclose(np.asarray(oc), np.asarray(od), rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(oc[2]).max()) == 0.0  # the empty row gives 0
  for a, b in zip(gc, gd):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(gc[3]).sum()) > 0 and float(jnp.abs(gc[4]).sum()) > 0


@pytest.mark.parametrize("score", ["softmax", "silu"])
def test_chunked_cross_attention_matches_dense(score):
  """Lq != Lk, the key-age bias bucket(dt_k) (cross attention), no position bias."""
  q, k, v, valid, dt, ttab, _ = heads(seed=1, lq=3)

  def f(impl, q, k, v, ttab):
    return multihead_attention(q, k, v, valid, score=score, time_table=ttab, dt_k=dt,
                               impl=impl)

  od, vjp_d = jax.vjp(jax.jit(lambda *a: f(DENSE, *a)), q, k, v, ttab)
  oc, vjp_c = jax.vjp(jax.jit(lambda *a: f(CHUNKED, *a)), q, k, v, ttab)
  np.testing.assert_allclose(np.asarray(oc), np.asarray(od), rtol=1e-5, atol=1e-5)
  g = jax.random.normal(jax.random.key(5), od.shape)
  for a, b in zip(vjp_c(g), vjp_d(g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score,mask", [("softmax", "causal"), ("silu", "full"),
                                        ("softmax", "block_local")])
def test_segments_equal_separate_sequences(score, mask):
  """Two sequences packed in one row with segment ids and in-segment positions give the
  outputs of each sequence alone (dense and chunked)."""
  q, k, v, _, dt, ttab, ptab = heads(seed=2, lengths=(L,))
  n1 = 16  # a multiple of block_size: blocks never straddle the two sequences
  seg = (jnp.arange(L) >= n1).astype(jnp.int32)[None]  # (1, L)
  pos = jnp.where(seg == 0, jnp.arange(L), jnp.arange(L) - n1)  # (1, L)
  valid = jnp.ones((1, L), bool)
  kw = dict(score=score, mask=mask, block_size=8, time_table=ttab, pos_table=ptab, norm=64.0)
  for impl in (DENSE, CHUNKED):
    packed = jax.jit(lambda q, k, v: multihead_attention(
        q, k, v, valid, dt_q=dt, dt_k=dt, seg_q=seg, seg_k=seg, pos_q=pos, pos_k=pos,
        impl=impl, **kw))(q, k, v)
    for sl in (slice(0, n1), slice(n1, L)):
      alone = multihead_attention(q[:, sl], k[:, sl], v[:, sl], valid[:, sl], dt_q=dt[:, sl],
                                  dt_k=dt[:, sl], impl=DENSE, **kw)
      np.testing.assert_allclose(np.asarray(packed[:, sl]), np.asarray(alone), rtol=1e-5,
                                 atol=1e-5)


@pytest.mark.parametrize("score,mask", [("softmax", "full"), ("silu", "causal")])
def test_chunked_padding_invariance(score, mask):
  """Garbage at padded keys (100-scale values, far times) never changes a valid output."""
  m = Attention(16, 2, score=score, mask=mask, rope=True, time_buckets=12,
                impl=CHUNKED, rngs=nnx.Rngs(0))
  q, _, _, valid, dt, _, _ = heads(seed=3)
  x = jax.random.normal(jax.random.key(7), (B, L, 16))
  f = jax.jit(lambda x, dt: m(x, valid, dt))
  y = f(x, dt)
  vm = valid[:, :, None]
  x2 = jnp.where(vm, x, 100.0 * jax.random.normal(jax.random.key(8), x.shape))
  dt2 = jnp.where(valid, dt, 1e9)
  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(f(x2, dt2))[v], np.asarray(y)[v], rtol=0, atol=1e-6)


def test_attention_module_chunked_equals_dense_and_bf16():
  md = Attention(16, 2, mask="causal", time_buckets=8, impl=DENSE, rngs=nnx.Rngs(1))
  mc = Attention(16, 2, mask="causal", time_buckets=8, impl=CHUNKED, rngs=nnx.Rngs(1))
  _, _, _, valid, dt, _, _ = heads(seed=4)
  x = jax.random.normal(jax.random.key(9), (B, L, 16))
  np.testing.assert_allclose(np.asarray(mc(x, valid, dt)), np.asarray(md(x, valid, dt)),
                             rtol=1e-5, atol=1e-5)
  # bf16 compute: chunked within 2e-2 (relative to the largest output) of the fp32 dense path.
  m16 = Attention(16, 2, mask="causal", time_buckets=8, impl=CHUNKED, dtype=jnp.bfloat16,
                  rngs=nnx.Rngs(1))
  y16, y32 = m16(x, valid, dt), np.asarray(md(x, valid, dt))
  assert y16.dtype == jnp.bfloat16
  err = np.abs(np.asarray(y16, np.float32) - y32).max() / np.abs(y32).max()
  assert err < 2e-2, err


def test_cross_attention_module_chunked():
  md = CrossAttention(16, 2, time_buckets=8, impl=DENSE, rngs=nnx.Rngs(2))
  mc = CrossAttention(16, 2, time_buckets=8, impl=CHUNKED, rngs=nnx.Rngs(2))
  _, _, _, valid, dt, _, _ = heads(seed=5)
  kv = jax.random.normal(jax.random.key(10), (B, L, 16))
  qx = jax.random.normal(jax.random.key(11), (B, 2, 16))
  np.testing.assert_allclose(np.asarray(mc(qx, kv, valid, dt)), np.asarray(md(qx, kv, valid, dt)),
                             rtol=1e-5, atol=1e-5)


def _temp_bytes(impl, n, score="softmax"):
  """Temporaries of one jitted forward + backward at length n (compiled memory analysis)."""
  b, h, dh = 2, 2, 16
  q = jax.ShapeDtypeStruct((b, n, h, dh), jnp.float32)
  valid = jax.ShapeDtypeStruct((b, n), jnp.bool_)
  dt = jax.ShapeDtypeStruct((b, n), jnp.float32)
  tab = jax.ShapeDtypeStruct((8, h), jnp.float32)

  def loss(q, k, v, tab, valid, dt):
    o = multihead_attention(q, k, v, valid, score=score, mask="causal", time_table=tab,
                            dt_q=dt, dt_k=dt, impl=impl)
    return jnp.sum(o * o)

  f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  return f.lower(q, q, q, tab, valid, dt).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("score", ["softmax", "silu"])
def test_chunked_memory_is_linear_in_length(score):
  impl = AttentionImpl("chunked", chunk_size=128)
  small, big = _temp_bytes(impl, 512, score), _temp_bytes(impl, 2048, score)
  assert big / small <= 4.5, (small, big)
  dense_small, dense_big = _temp_bytes(DENSE, 512, score), _temp_bytes(DENSE, 2048, score)
  assert dense_big / dense_small > 10, (dense_small, dense_big)
  assert big < dense_big / 4


def test_select_impl_dispatch():
  kw = dict(score="softmax", recent_first=False, Lq=2048, dh=64, dtype=jnp.bfloat16,
            has_bias=False, has_segments=False)
  auto = AttentionImpl("auto", dense_max=1024)
  assert select_impl(auto, mask="full", Lk=1024, platform="gpu", **kw) == "dense"
  assert select_impl(auto, mask="full", Lk=2048, platform="cpu", **kw) == "chunked"
  assert select_impl(auto, mask="full", Lk=2048, platform="gpu", **kw) == "cudnn"
  assert select_impl(auto, mask="causal", Lk=2048, platform="gpu", **kw) == "cudnn"
  assert select_impl(auto, mask="block_local", Lk=2048, platform="gpu", **kw) == "blocked"
  # Where cuDNN does not apply, 'auto' falls back to the chunked path ...
  for change in (dict(score="silu"), dict(has_bias=True), dict(has_segments=True),
                 dict(recent_first=True), dict(dtype=jnp.float32), dict(dh=12)):
    assert select_impl(auto, mask="causal", Lk=2048, platform="gpu", **{**kw, **change}) \
        == "chunked", change
  # ... and asking for it explicitly is an error.
  with pytest.raises(ValueError, match="does not apply"):
    select_impl(AttentionImpl("cudnn"), mask="full", Lk=2048, **{**kw, "score": "silu"})
  assert sdpa_applies(mask="full", Lk=2048, cudnn=False, **{**kw, "dtype": jnp.float32})
  with pytest.raises(ValueError, match="expected one of"):
    AttentionImpl("flash")


@pytest.mark.parametrize("mask,recent_first", [("full", True), ("causal", False)])
def test_sdpa_route_matches_dense(mask, recent_first):
  """The jax.nn.dot_product_attention route (implementation='xla' on CPU) == dense."""
  q, k, v, valid, _, _, _ = heads(seed=6)
  kw = dict(mask=mask, recent_first=recent_first)
  od = multihead_attention(q, k, v, valid, impl=DENSE, **kw)
  os_ = multihead_attention(q, k, v, valid, impl=AttentionImpl("xla_sdpa"), **kw)
  v_ = np.asarray(valid) if mask == "causal" else np.ones(valid.shape, bool)
  np.testing.assert_allclose(np.asarray(os_)[v_], np.asarray(od)[v_], rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(os_[2]).max()) == 0.0


def test_tile_pairs_without_allowed_entries_are_skipped():
  """The skip table: causal keeps one triangle of tile pairs, packed segments the tiles
  whose segment ranges meet, and a key tile without valid keys is skipped in every row."""
  from gem_jax.layers.chunked import Bias, _Cfg, _tiles
  n, c = 32, 8
  q = jnp.zeros((1, n, 1, 4))
  valid = jnp.arange(n)[None] < 28  # the last tile has 4 valid keys, none past 28
  cfg = _Cfg("softmax", 1.0, 1.0, True, True, c)
  _, _, need, _ = _tiles(cfg, q, q, q, valid, Bias())
  np.testing.assert_array_equal(np.asarray(need), np.triu(np.ones((4, 4), bool)))
  _, _, need, _ = _tiles(cfg._replace(recent_first=False), q, q, q, valid, Bias())
  np.testing.assert_array_equal(np.asarray(need), np.tril(np.ones((4, 4), bool)))
  seg = jnp.asarray(np.repeat([0, 1, 2, 3], 8))[None]  # one history per tile
  _, _, need, _ = _tiles(cfg._replace(causal=False), q, q, q, valid, Bias(seg_q=seg, seg_k=seg))
  np.testing.assert_array_equal(np.asarray(need), np.eye(4, dtype=bool))
  _, _, need, _ = _tiles(cfg._replace(causal=False), q, q, q, jnp.arange(n)[None] < 16,
                         Bias())
  np.testing.assert_array_equal(np.asarray(need), np.array([[1, 1, 0, 0]] * 4, bool))
