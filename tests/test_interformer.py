"""Gating, PFFN and InterFormerBlock (single and multi-stream) against float64 NumPy references;
jagged invariance, stream independence, FLOPs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import references as R
from gem_jax.layers.interformer import (PFFN, Gating, InterFormerBlock, interformer_flops,
                                        sequence_branch_flops)
from test_attention import D, H, inputs, np_, randomize_params, scramble_padding

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


def _branch_kw(br, mask):
  return dict(heads=br.attn.num_heads, num_recent=br.num_recent, score=br.attn.score,
              mask=mask, block=br.attn.block_size, rope_on=br.attn.rope)


def ref_gating(g, x):
  return R.gating(R.params(g), x)


def ref_pffn(p, x_sum, s):
  return R.pffn(R.params(p), x_sum, s)


def ref_x_summary(blk, x):
  return R.x_summary(R.params(blk), x)


def ref_branch(br, x_sum, s, valid, dt, mask="causal"):
  """Float64 reference of one stream's SequenceBranch: (s' (B, L, D), s_sum (B, 8, D))."""
  return R.sequence_branch(R.params(br), x_sum, s, valid, dt, **_branch_kw(br, mask))


def ref_block(blk, x, streams):
  """Float64 reference of InterFormerBlock: X_sum once, one branch per stream, interaction."""
  return R.interformer_block(R.params(blk), x, streams,
                             lambda z: ref_mixer(blk.interaction, z), n_tokens=N_X,
                             **_branch_kw(blk.branches[0], "causal"))


def _inputs(seed=0):
  s, valid, dt = inputs(seed=seed)
  x = jax.random.normal(jax.random.key(seed + 100), (s.shape[0], N_X, D))
  return x, s, valid, dt


def _block(n_out=None, seed=0, num_streams=1, **kw):
  n_in = N_X + num_streams * N_S
  mixer = TokenMixer(n_in, n_out or n_in, nnx.Rngs(seed + 1))
  kw = dict(dict(mask="causal", rope=True, time_buckets=10), **kw)
  return InterFormerBlock(D, N_X, H, interaction=mixer, rngs=nnx.Rngs(seed),
                          num_streams=num_streams, **kw)


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
  x_ref, (s_ref,), xs_ref, ss_ref = ref_block(blk, x, [(s, valid, dt)])
  v = np.asarray(valid)
  for i, (got, ref) in enumerate(zip(out, (x_ref, s_ref, xs_ref, ss_ref))):
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


def _two_streams(seed=0):
  """Stream 0: (3, 10) events of lengths (7, 10, 0); stream 1: (3, 6) of lengths (2, 6, 4)."""
  x, s0, v0, dt0 = _inputs(seed)
  s1, v1, dt1 = inputs(seed=seed + 7, n=6, lengths=(2, 6, 4))
  return x, [(s0, v0, dt0), (s1, v1, dt1)]


@pytest.fixture(scope="module")
def multi_block_and_fn():
  """A 2-stream block (separate branch weights) through a plain jax.jit."""
  blk = randomize_params(_block(num_streams=2, seed=4))
  graphdef, state = nnx.split(blk)

  @jax.jit
  def fn(state, x, streams):
    return nnx.merge(graphdef, state)(x, streams=streams)

  return blk, lambda *a: fn(state, *a)


def test_multi_stream_matches_per_stream_reference(multi_block_and_fn):
  """Each stream through its own branch (float64 reference per stream), S_sum concatenated."""
  blk, fn = multi_block_and_fn
  x, streams = _two_streams()
  x_new, seqs, x_sum, s_sum = fn(x, streams)
  assert x_new.shape == (3, N_X, D) and x_sum.shape == (3, 4, D)
  assert [q.shape for q in seqs] == [(3, 10, D), (3, 6, D)] and s_sum.shape == (3, 2 * N_S, D)
  x_ref, s_refs, xs_ref, ss_ref = ref_block(blk, x, streams)
  for got, ref, (_, v, _) in zip(seqs, s_refs, streams):
    v = np.asarray(v)
    np.testing.assert_allclose(np.asarray(got)[v], ref[v], rtol=2e-5, atol=2e-5)
  for got, ref in ((x_new, x_ref), (x_sum, xs_ref), (s_sum, ss_ref)):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)
  # the branches have separate weights
  assert not np.allclose(np_(blk.branches[0].attn.qkv.kernel), np_(blk.branches[1].attn.qkv.kernel))


def test_multi_stream_streams_are_independent(multi_block_and_fn):
  """New valid events in stream 1 leave stream 0's S' and S_sum,0 bit-identical."""
  _, fn = multi_block_and_fn
  x, streams = _two_streams()
  out = fn(x, streams)
  s1, v1, dt1 = streams[1]
  other = jax.random.normal(jax.random.key(99), s1.shape)
  changed = [streams[0], (jnp.where(v1[..., None], other, s1), v1, dt1 * 3.0)]
  out2 = fn(x, changed)
  v0 = np.asarray(streams[0][1])
  np.testing.assert_array_equal(np.asarray(out2[1][0])[v0], np.asarray(out[1][0])[v0])
  np.testing.assert_array_equal(np.asarray(out2[3][:, :N_S]), np.asarray(out[3][:, :N_S]))
  np.testing.assert_array_equal(np.asarray(out2[2]), np.asarray(out[2]))  # X_sum: from X only
  # ...while stream 1's own outputs, S_sum,1 and the interaction output X' do change
  v1 = np.asarray(v1)
  assert np.max(np.abs(np.asarray(out2[1][1])[v1] - np.asarray(out[1][1])[v1])) > 1e-3
  assert np.max(np.abs(np.asarray(out2[3][:, N_S:]) - np.asarray(out[3][:, N_S:]))) > 1e-3
  assert np.max(np.abs(np.asarray(out2[0]) - np.asarray(out[0]))) > 1e-4


def test_multi_stream_padding_invariance(multi_block_and_fn):
  _, fn = multi_block_and_fn
  x, streams = _two_streams()
  out = fn(x, streams)
  scrambled = [(*scramble_padding(v, s, dt, seed=3 + i),) for i, (s, v, dt) in enumerate(streams)]
  out2 = fn(x, [(s, v, dt) for (s, dt), (_, v, _) in zip(scrambled, streams)])
  for a, b, (_, v, _) in zip(out[1], out2[1], streams):
    v = np.asarray(v)
    np.testing.assert_allclose(np.asarray(b)[v], np.asarray(a)[v], rtol=0, atol=1e-6)
  for i in (0, 2, 3):
    np.testing.assert_allclose(np.asarray(out2[i]), np.asarray(out[i]), rtol=0, atol=1e-6)


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
  br = grads.branches[0]
  for g in (br.cls, grads.x_mix, br.pma.seeds, br.attn.time_bias, br.pffn.w_k.kernel,
            grads.interaction.w_t):
    assert float(jnp.abs(g[...]).sum()) > 0
  assert blk.x_fc1.kernel.get_metadata()["logical_axes"] == ("embed", "mlp")


def test_interformer_rejects_bad_interaction_and_streams():
  blk = _block(n_out=3)
  x, s, valid, dt = _inputs()
  graphdef, state = nnx.split(blk)
  with pytest.raises(ValueError, match="interaction returned 3 tokens"):
    jax.eval_shape(lambda st: nnx.merge(graphdef, st)(x, s, valid, dt), state)
  with pytest.raises(ValueError, match="needs dt"):
    blk(x, s, valid)
  two = _block(num_streams=2)
  with pytest.raises(ValueError, match="got 1 streams, the block has 2"):
    two(x, s, valid, dt)  # the single-stream form needs a 1-stream block
  with pytest.raises(ValueError, match="not both"):
    two(x, s, valid, dt, streams=[(s, valid, dt)] * 2)


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


def test_interformer_flops_per_stream():
  """X_sum counted once, one branch per stream (exact formula)."""
  n, d = 8, 16
  x_part = 2 * 4 * n * d + 4 * 4 * d * d + 4 * 4 * d * d
  b = [sequence_branch_flops(L, d) for L in (10, 3)]
  assert interformer_flops(n, 10, d) == x_part + b[0]
  assert interformer_flops(n, [10, 3], d) == x_part + b[0] + b[1]
  assert b[1] == (4 * 4 * d * d + 4 * 3 * 4 * d + 8 * 7 * d * d + 4 * 7 * 7 * d
                  + (4 * 2 * d * d + 4 * 3 * d * d + 4 * 2 * 3 * d) + 4 * 8 * d * d)


def test_hstu_sequence_layer_chunked_equals_dense_and_padding():
  """seq_layer='hstu': the branch's sublayer is HSTU; chunked == dense; padding invariant."""
  from gem_jax.layers.attention import AttentionImpl
  bd = randomize_params(_block(seq_layer="hstu", impl=AttentionImpl("dense")))
  bc = _block(seq_layer="hstu", impl=AttentionImpl("chunked", chunk_size=4))
  nnx.update(bc, nnx.state(bd, nnx.Param))
  assert bd.branches[0].attn is None and bd.branches[0].hstu is not None
  x, s, valid, dt = _inputs()
  call = nnx.jit(lambda m, *a: m(*a))   # eagerly, a chunked block dispatches op by op
  out_d, out_c = call(bd, x, s, valid, dt), call(bc, x, s, valid, dt)
  v = np.asarray(valid)
  for i, (a, b) in enumerate(zip(out_d, out_c)):
    a, b = np.asarray(a), np.asarray(b)
    if i == 1:
      a, b = a[v], b[v]
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"output {i}")
  s2, dt2 = scramble_padding(valid, s, dt)
  out2 = call(bc, x, s2, valid, dt2)
  np.testing.assert_allclose(np.asarray(out2[3]), np.asarray(out_c[3]), atol=1e-6)
  base = interformer_flops(N_X, 10, D, mask="causal")
  hstu = interformer_flops(N_X, 10, D, mask="causal", seq_layer="hstu")
  assert hstu - base == 2 * (4 + 10) * D * D  # HSTU: 10 L D^2 vs attention's 8 L D^2
