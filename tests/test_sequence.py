"""SequenceBlock and PyramidStack against float64 NumPy references; jagged invariance; remat."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import references as R
from gem_jax.layers.sequence import (PyramidStack, SequenceBlock, pyramid_flops,
                                     sequence_block_flops)
from test_attention import D, H, inputs, randomize_params, scramble_padding


# Float64 references: tests/references.py (shared with the GEM forward test).
def ref_block(blk, x, valid, dt, mask, block):
  return R.sequence_block(R.params(blk), x, valid, dt, heads=blk.attn.num_heads,
                          score=blk.attn.score, mask=mask, block=block, rope_on=blk.attn.rope)


def ref_branch(br, x, valid, dt, mask, block):
  """Float64 reference of one PyramidBranch (module docstring of gem_jax.layers.sequence)."""
  attn = br.stages[0][0].attn
  return R.pyramid_branch(R.params(br), x, valid, dt, stage_lengths=br.stage_lengths,
                          reduce=br.reduce, num_summary=br.num_summary, heads=attn.num_heads,
                          score=attn.score, mask=mask, block=block, rope_on=attn.rope)


CASES = [(s, m) for s in ("softmax", "silu") for m in ("full", "causal", "block_local")]


@pytest.mark.parametrize("score,mask", CASES)
def test_sequence_block_matches_reference_and_padding(score, mask):
  blk = randomize_params(SequenceBlock(D, H, 2, score=score, mask=mask, block_size=4,
                                       rope=True, time_buckets=10, rngs=nnx.Rngs(0)))
  x, valid, dt = inputs()
  f = jax.jit(lambda x, dt: blk(x, valid, dt))
  y = f(x, dt)
  v = np.asarray(valid)
  ref = ref_block(blk, x, valid, dt, mask, 4)
  np.testing.assert_allclose(np.asarray(y)[v], ref[v], rtol=1e-5, atol=1e-5)
  x2, dt2 = scramble_padding(valid, x, dt)
  np.testing.assert_allclose(np.asarray(f(x2, dt2))[v], np.asarray(y)[v], rtol=0, atol=1e-6)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_sequence_block_remat_same_values_and_grads(remat):
  x, valid, dt = inputs()
  base = SequenceBlock(D, H, 2, mask="block_local", block_size=4, rngs=nnx.Rngs(0))
  ckpt = SequenceBlock(D, H, 2, mask="block_local", block_size=4, remat=remat, rngs=nnx.Rngs(0))

  def loss(m, x):
    return jnp.sum(jnp.tanh(m(x, valid, dt)))

  g0 = jax.jit(nnx.grad(loss, argnums=(0, 1)))(base, x)
  g1 = jax.jit(nnx.grad(loss, argnums=(0, 1)))(ckpt, x)
  np.testing.assert_allclose(np.asarray(g1[1]), np.asarray(g0[1]), rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g0[0]), jax.tree.leaves(g1[0])):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(g1))
  # The checkpointed function really is in the graph.
  graphdef, state = nnx.split(ckpt)
  jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, valid, dt))(state, x)
  assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


def test_sequence_block_bf16_compute_fp32_params():
  blk = SequenceBlock(D, H, 2, dtype=jnp.bfloat16, rope=True, time_buckets=8, rngs=nnx.Rngs(0))
  x, valid, dt = inputs()
  y = blk(x, valid, dt)
  assert y.shape == x.shape and y.dtype == jnp.bfloat16
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(blk, nnx.Param)))
  assert blk.ffn.up.kernel.get_metadata()["logical_axes"] == ("embed", "mlp")
  assert blk.ffn.down.kernel.get_metadata()["logical_axes"] == ("mlp", "embed")


def _streams(seed=0):
  """Two streams: L=10 (lengths 7, 10, 0) and L=6 (lengths 2, 6, 5)."""
  a = inputs(seed=seed)
  b = inputs(seed=seed + 1, n=6, lengths=(2, 6, 5))
  return [a, b]


@pytest.fixture(scope="module", params=["recent", "pma"])
def pyramid(request):
  ps = randomize_params(PyramidStack(2, D, H, stage_lengths=(8, 4), reduce=request.param,
                                     num_summary=3, ffn_mult=2, mask="causal", rope=True,
                                     time_buckets=10, rngs=nnx.Rngs(0)))
  return ps, jax.jit(lambda streams: ps(streams))


def test_pyramid_matches_reference(pyramid):
  ps, f = pyramid
  streams = _streams()
  y = f(streams)
  assert y.shape == (3, 2 * 3, D) and y.dtype == jnp.float32
  ref = np.concatenate([ref_branch(br, *s, mask="causal", block=64)
                        for br, s in zip(ps.branches, streams)], axis=1)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
  if ps.branches[0].reduce == "recent":  # the empty history gives all-zero summary tokens
    assert float(jnp.abs(y[2, :3]).max()) == 0.0


def test_pyramid_padding_invariance(pyramid):
  ps, f = pyramid
  streams = _streams()
  y = f(streams)
  scrambled = []
  for i, (x, v, dt) in enumerate(streams):
    x2, dt2 = scramble_padding(v, x, dt, seed=5 + i)
    scrambled.append((x2, v, dt2))
  y2 = f(scrambled)
  np.testing.assert_allclose(np.asarray(y2), np.asarray(y), rtol=0, atol=1e-6)


def test_pyramid_crops_to_newest_events():
  ps = PyramidStack(1, D, H, stage_lengths=(8,), num_summary=2, ffn_mult=2, rngs=nnx.Rngs(2))
  x, v, dt = inputs()
  long = (jnp.concatenate([x, x[:, :5]], 1), jnp.concatenate([v, v[:, :5]], 1),
          jnp.concatenate([dt, dt[:, :5]], 1))  # 15 > L_0 = 8 events
  cropped = tuple(a[:, :8] for a in long)
  np.testing.assert_array_equal(np.asarray(ps([long])), np.asarray(ps([cropped])))


def test_pyramid_grads_finite_bf16():
  ps = PyramidStack(1, D, H, stage_lengths=(8, 4), reduce="pma", num_summary=2, ffn_mult=2,
                    score="silu", mask="block_local", block_size=4, time_buckets=6,
                    dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  streams = _streams()[1:]

  def loss(m, s):
    out = m(s)
    return jnp.sum(out.astype(jnp.float32) ** 2), out

  (_, out), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(ps, streams)
  assert out.shape == (3, 2, D) and out.dtype == jnp.bfloat16
  leaves = jax.tree.leaves(grads)
  assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all()) for g in leaves)
  assert float(jnp.abs(grads.branches[0].pmas[0].seeds[...]).sum()) > 0


def test_sequence_block_and_pyramid_flops_match_xla():
  n, d = 128, 128
  blk = SequenceBlock(d, 2, 2, mask="block_local", block_size=32, qk_norm=False,
                      rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(blk)
  x, valid = jnp.zeros((1, n, d)), jnp.ones((1, n), bool)
  cost = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, valid)).lower(state, x).compile()
  cost = cost.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  want = sequence_block_flops(n, d, 2, mask="block_local", block_size=32)
  assert abs(cost["flops"] / want - 1) < 0.10, (cost["flops"], want)
  assert pyramid_flops(n, d, (n,), "recent", 4, ffn_mult=2, mask="block_local",
                       block_size=32) == want
  # 'pma' adds the two PMA reductions; 'recent' never runs a stage longer than its input.
  assert pyramid_flops(100, d, (128, 64), "recent", 4) == \
      sequence_block_flops(100, d, 4) + sequence_block_flops(64, d, 4)


def test_hstu_layer_option_of_the_pyramid():
  """layer='hstu': HSTU blocks (no FFN), chunked == dense, padding invariant, FLOPs count."""
  from gem_jax.layers.attention import AttentionImpl
  kw = dict(layer="hstu", mask="causal", time_buckets=10, rngs=nnx.Rngs(0))
  sd = PyramidStack(1, D, H, (10, 4), "recent", 2, impl=AttentionImpl("dense"), **kw)
  sc = PyramidStack(1, D, H, (10, 4), "recent", 2,
                    impl=AttentionImpl("chunked", chunk_size=4), **kw)
  randomize_params(sd)
  nnx.update(sc, nnx.state(sd, nnx.Param))
  x, valid, dt = inputs()
  run = jax.jit(lambda x, dt: sd([(x, valid, dt)]))
  y = run(x, dt)
  assert y.shape == (3, 2, D)
  np.testing.assert_allclose(np.asarray(sc([(x, valid, dt)])), np.asarray(y), rtol=1e-5,
                             atol=1e-5)
  x2, dt2 = scramble_padding(valid, x, dt)  # the same program on other padding: bit-exact
  np.testing.assert_array_equal(np.asarray(run(x2, dt2)), np.asarray(y))
  assert pyramid_flops(10, D, (10, 4), layer="hstu") == \
      10 * 10 * D * D + 4 * 10 * 10 * D + 10 * 4 * D * D + 4 * 4 * 4 * D
  with pytest.raises(ValueError, match="not options of the HSTU layer"):
    PyramidStack(1, D, H, (10,), layer="hstu", rope=True, rngs=nnx.Rngs(0))
