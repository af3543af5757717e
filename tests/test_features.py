"""Front end: dense tokens, sparse projection, sequence embedding (numpy references, masks)."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import references as R
from gem_jax.layers.features import (DenseTokenizer, SequenceEmbedder, SparseProjector,
                                     lengths_to_mask, log_time_bucket)


def test_dense_tokenizer_shape_and_reference():
  m = DenseTokenizer(5, 3, 4, (8,), rngs=nnx.Rngs(0))
  x = np.random.default_rng(0).normal(size=(2, 5)).astype(np.float32)
  ref = R.dense_tokenizer(R.params(m), x, 3)  # (2, 3, 4)
  np.testing.assert_allclose(np.asarray(m(jnp.asarray(x))), ref, rtol=1e-5, atol=1e-6)


def test_sparse_projector_projects_only_other_widths():
  dims = {"a": 4, "b": 8, "c": 4, "d": 6}
  m = SparseProjector(dims, 4, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  x = {k: rng.normal(size=(3, v)).astype(np.float32) for k, v in dims.items()}
  y = np.asarray(m({k: jnp.asarray(v) for k, v in x.items()}))
  assert y.shape == (3, 4, 4)
  np.testing.assert_array_equal(y[:, 0], x["a"])  # same width: identity
  np.testing.assert_array_equal(y[:, 2], x["c"])
  np.testing.assert_allclose(y[:, 1], x["b"] @ np.asarray(m.proj["8"][...])[0], rtol=1e-5)
  np.testing.assert_allclose(y[:, 3], x["d"] @ np.asarray(m.proj["6"][...])[0], rtol=1e-5)
  assert sorted(m.proj.keys()) == ["6", "8"]


def test_time_buckets_and_mask():
  dt = jnp.asarray([0.0, 0.5, 1.0, 3.0, 1e9, -5.0])
  np.testing.assert_array_equal(np.asarray(log_time_bucket(dt, 8)), [0, 0, 1, 2, 7, 0])
  m = lengths_to_mask(jnp.asarray([0, 2, 3]), 3)
  np.testing.assert_array_equal(np.asarray(m), [[0, 0, 0], [1, 1, 0], [1, 1, 1]])


def _seq_inputs(rng, b=2, l=5):
  items = {"i0": rng.normal(size=(b, l, 4)).astype(np.float32),
           "i1": rng.normal(size=(b, l, 6)).astype(np.float32)}
  action = rng.integers(0, 3, size=(b, l)).astype(np.int32)
  surface = rng.integers(0, 2, size=(b, l)).astype(np.int32)
  dt = rng.uniform(0, 1e4, size=(b, l)).astype(np.float32)
  mask = np.asarray(lengths_to_mask(jnp.asarray([3, 5]), l))
  return items, action, surface, dt, mask


def test_sequence_embedder_reference_and_padding():
  rng = np.random.default_rng(2)
  m = SequenceEmbedder({"i0": 4, "i1": 6}, 8, num_actions=3, num_surfaces=2, time_buckets=16,
                       rngs=nnx.Rngs(0))
  items, action, surface, dt, mask = _seq_inputs(rng)
  x, valid, dt_out = m({k: jnp.asarray(v) for k, v in items.items()}, action, surface, dt, mask)
  assert x.shape == (2, 5, 8) and valid.dtype == jnp.bool_
  e = np.concatenate([items["i0"], items["i1"]], -1)
  ref, _, _ = R.sequence_embedder(R.params(m), e, action, surface, dt, mask)
  np.testing.assert_allclose(np.asarray(x), ref, rtol=1e-4, atol=1e-5)
  # random values in padded events change nothing
  items2 = {k: np.where(mask[..., None], v, rng.normal(size=v.shape) * 100).astype(np.float32)
            for k, v in items.items()}
  dt2 = np.where(mask, dt, 1e8).astype(np.float32)
  x2, _, dt_out2 = m({k: jnp.asarray(v) for k, v in items2.items()}, action, surface, dt2, mask)
  np.testing.assert_array_equal(np.asarray(x), np.asarray(x2))
  np.testing.assert_array_equal(np.asarray(dt_out), np.asarray(dt_out2))


def test_sequence_embedder_bf16_and_grads_finite():
  rng = np.random.default_rng(3)
  m = SequenceEmbedder({"i0": 4, "i1": 6}, 8, num_actions=3, num_surfaces=2, rngs=nnx.Rngs(0),
                       dtype=jnp.bfloat16)
  items, action, surface, dt, mask = _seq_inputs(rng)
  x, _, _ = m(items, action, surface, dt, mask)
  assert x.dtype == jnp.bfloat16 and m.item_proj.kernel[...].dtype == jnp.float32
  g = nnx.grad(lambda m: jnp.sum(m(items, action, surface, dt, mask)[0].astype(jnp.float32) ** 2))(m)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))
