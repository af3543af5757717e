"""Multi-domain multi-task heads and the masked BCE against numpy references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import references as R
from gem_jax.layers.heads import MultiTaskHeads, masked_multitask_bce

B, H, T, NDOM = 6, 8, 3, 2


def _np_grouped(m, x, g):
  """Group g of a GroupedMLP (tests/references.py)."""
  return R.grouped_mlp(R.params(m), x, g, final=m.final_activation)


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(B, H)).astype(np.float32),
          np.asarray([0, 1, 1, 0, 1, 0], np.int32))


def _randomize(m, seed):
  """Non-zero values everywhere (gates start at 0), so the reference is not trivial."""
  g, s = nnx.split(m)
  leaves, tree = jax.tree.flatten(s)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [0.3 * jax.random.normal(k, v.shape, v.dtype) for k, v in zip(keys, leaves)]
  return nnx.merge(g, jax.tree.unflatten(tree, leaves))


def test_towers_select_domain(data):
  h, dom = data
  m = _randomize(MultiTaskHeads(H, T, NDOM, kind="towers", hidden=(5,), rngs=nnx.Rngs(0)), 1)
  y = m(jnp.asarray(h), jnp.asarray(dom))
  assert y.shape == (B, T) and y.dtype == jnp.float32
  ref = R.heads(R.params(m), h, dom)  # Tower_{dom[b]}(h[b]) per row
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
  assert m.towers.kernels[0].get_metadata()["logical_axes"] == ("domains", None, None)


def test_mmoe_reference(data):
  h, dom = data
  m = _randomize(MultiTaskHeads(H, T, NDOM, kind="mmoe", hidden=(5,), num_experts=3,
                                expert_hidden=(7,), rngs=nnx.Rngs(0)), 2)
  y = np.asarray(m(jnp.asarray(h), jnp.asarray(dom)))
  gates = np.asarray(m.gates[...])  # (D, H, T * E)
  for b in range(B):
    experts = np.stack([_np_grouped(m.experts, h[b], e) for e in range(3)])  # (E, 7)
    g = (h[b] @ gates[dom[b]]).reshape(T, 3)
    g = np.exp(g - g.max(-1, keepdims=True))
    g /= g.sum(-1, keepdims=True)
    for t in range(T):
      z = g[t] @ experts
      np.testing.assert_allclose(y[b, t], _np_grouped(m.task_towers, z, t)[0], rtol=1e-4,
                                 atol=1e-5)


@pytest.mark.parametrize("kind", ["towers", "mmoe"])
def test_heads_bf16_grads(data, kind):
  h, dom = data
  m = MultiTaskHeads(H, T, NDOM, kind=kind, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  y = m(jnp.asarray(h), jnp.asarray(dom))
  assert y.dtype == jnp.float32 and y.shape == (B, T)
  g = nnx.jit(nnx.grad(lambda m: jnp.mean(m(jnp.asarray(h), jnp.asarray(dom)) ** 2)))(m)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))


def test_masked_bce_reference():
  rng = np.random.default_rng(3)
  z = rng.normal(size=(5, 2)).astype(np.float32) * 3
  y = rng.integers(0, 2, size=(5, 2)).astype(np.float32)
  m = np.asarray([[1, 0], [1, 1], [0, 0], [1, 1], [0, 1]], np.float32)
  bce = -(y * np.log(1 / (1 + np.exp(-z))) + (1 - y) * np.log(1 - 1 / (1 + np.exp(-z))))
  got = masked_multitask_bce(z, y, m)
  assert got.dtype == jnp.float32 and got.shape == ()
  np.testing.assert_allclose(float(got), (bce * m).sum() / m.sum(), rtol=1e-5)
  tw, dom, dw = np.asarray([2.0, 0.5]), np.asarray([0, 1, 0, 1, 1]), np.asarray([1.0, 3.0])
  ref = (bce * m * tw[None] * dw[dom][:, None]).sum() / m.sum()
  np.testing.assert_allclose(float(masked_multitask_bce(z, y, m, tw, dom, dw)), ref, rtol=1e-5)
  # unobserved labels carry no loss and no gradient
  g = jax.grad(lambda z: masked_multitask_bce(z, y, m))(jnp.asarray(z))
  assert float(jnp.max(jnp.abs(g * (1 - m)))) == 0.0
  assert float(masked_multitask_bce(z, y, np.zeros_like(m))) == 0.0
  big = masked_multitask_bce(jnp.asarray([[80.0]]), jnp.asarray([[0.0]]), jnp.ones((1, 1)))
  np.testing.assert_allclose(float(big), 80.0, rtol=1e-6)  # stable for large logits
