"""Packing jagged histories into token rows: plan, round trip, bad input, and an HSTU stack
on packed rows == the same stack on padded rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.data.packing import check_lengths, pack, pack_plan, truncate, unpack
from gem_jax.layers.attention import AttentionImpl
from gem_jax.layers.hstu import HSTU


def test_plan_places_every_history_once():
  lengths = np.array([5, 0, 8, 3, 8, 1, 2])
  plan = pack_plan(lengths, 8)
  assert plan.rows == 4 and plan.valid.sum() == lengths.sum()  # 27 tokens in 4 rows of 8
  for i, n in enumerate(lengths):
    got = np.argwhere(plan.user == i)
    assert len(got) == n
    if n:
      assert (got[:, 0] == plan.row[i]).all()  # one row, contiguous, positions 0..n-1
      np.testing.assert_array_equal(plan.pos[plan.user == i], np.arange(n))
      assert len(np.unique(plan.seg[plan.user == i])) == 1  # one segment per history
  assert plan.row[1] == -1  # the empty history takes no token
  assert (plan.user[~plan.valid] == -1).all()
  assert (np.diff(plan.seg, axis=1) >= 0).all()  # segment ids increase along each row
  assert pack_plan(lengths, 8, num_rows=5).rows == 5
  with pytest.raises(ValueError, match="only 3 allowed"):
    pack_plan(lengths, 8, num_rows=3)
  with pytest.raises(ValueError, match="truncate first"):
    pack_plan([9], 8)


def test_pack_unpack_round_trip():
  lengths = np.array([3, 6, 0, 2])
  L = 6
  x = jax.random.normal(jax.random.key(0), (4, L, 5))
  plan = pack_plan(lengths, 7)
  xp = pack(x, plan)
  assert xp.shape == (plan.rows, 7, 5)
  back = unpack(xp, plan, L)
  valid = np.arange(L)[None] < lengths[:, None]
  np.testing.assert_array_equal(np.asarray(back)[valid], np.asarray(x)[valid])
  assert float(jnp.abs(back[~valid]).max()) == 0.0
  assert float(jnp.abs(xp[~plan.valid]).max()) == 0.0


def test_truncation_and_bad_lengths():
  kept, cut = truncate([10, 3, 0, 7], 5)
  np.testing.assert_array_equal(kept, [5, 3, 0, 5])
  assert (cut.histories, cut.events) == (2, 7)
  with pytest.raises(ValueError, match="negative"):
    truncate([1, -1], 5)
  with pytest.raises(ValueError, match="at row 1"):
    check_lengths([3, 9], 8)  # a length that disagrees with the padded data


def test_hstu_on_packed_rows_equals_padded_rows():
  """Each history's outputs (and gradients through pack/unpack) are those of its own padded
  row: segment mask, in-segment positions for the position bias, N = the padded width."""
  L, D = 12, 16
  lengths = np.array([12, 4, 0, 7, 5, 1])
  kw = dict(time_buckets=8, pos_buckets=6, norm_len=L, rngs=nnx.Rngs(0))
  m = HSTU(D, 2, impl=AttentionImpl("chunked", chunk_size=4), **kw)
  keys = iter(jax.random.split(jax.random.key(1), 50))
  nnx.update(m, jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape),
                             nnx.state(m, nnx.Param)))
  x = jax.random.normal(jax.random.key(2), (len(lengths), L, D))
  dt = jnp.cumsum(jnp.exp(3.0 * jax.random.uniform(jax.random.key(3), (len(lengths), L))), 1)
  valid = jnp.asarray(np.arange(L)[None] < lengths[:, None])
  plan = pack_plan(lengths, 16)
  assert plan.rows < len(lengths)

  def padded(x):
    return m(x, valid, dt)

  def packed(x):
    yp = m(pack(x, plan), jnp.asarray(plan.valid), pack(dt, plan), seg=jnp.asarray(plan.seg),
           pos=jnp.asarray(plan.pos))
    return unpack(yp, plan, L)

  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(packed(x))[v], np.asarray(padded(x))[v], rtol=1e-5,
                             atol=1e-5)
  w = jnp.where(valid[..., None], jax.random.normal(jax.random.key(4), x.shape), 0.0)
  gp = jax.grad(lambda x: jnp.sum(packed(x) * w))(x)
  gd = jax.grad(lambda x: jnp.sum(padded(x) * w))(x)
  np.testing.assert_allclose(np.asarray(gp)[v], np.asarray(gd)[v], rtol=1e-5, atol=1e-5)


def test_balance_gives_equal_histories_and_near_equal_events():
  from gem_jax.data.packing import balance
  rng = np.random.default_rng(0)
  lengths = np.clip(np.round(rng.lognormal(np.log(300), 1.0, 64)), 1, 4096).astype(int)
  perm = balance(lengths, 8)
  assert sorted(perm) == list(range(64))
  per_shard = lengths[perm].reshape(8, 8).sum(1)
  assert per_shard.max() - per_shard.min() <= lengths.max()
  naive = lengths.reshape(8, 8).sum(1)
  assert per_shard.max() - per_shard.min() < naive.max() - naive.min()
  with pytest.raises(ValueError, match="equal shards"):
    balance(lengths[:63], 8)
