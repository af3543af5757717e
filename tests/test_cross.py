"""DCNv2 low-rank cross net against the TorchRec formula in numpy."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax.layers.cross import LowRankCrossNet


def test_cross_net_reference_and_grads():
  n, r, layers = 12, 4, 3
  m = LowRankCrossNet(n, layers, r, rngs=nnx.Rngs(0))
  for w in m.w:
    w.bias[...] = jax.random.normal(jax.random.key(1), (n,)) * 0.1
  x0 = np.random.default_rng(0).normal(size=(5, n)).astype(np.float32)
  x = x0.astype(np.float64)
  for v, w in zip(m.v, m.w):
    V, W = np.asarray(v.kernel[...]).T, np.asarray(w.kernel[...]).T  # (r, N), (N, r)
    x = x0 * ((W @ (V @ x.T)).T + np.asarray(w.bias[...])) + x
  y = m(jnp.asarray(x0))
  assert y.shape == (5, n)
  np.testing.assert_allclose(np.asarray(y), x, rtol=1e-4, atol=1e-5)
  g = nnx.grad(lambda m: jnp.mean(m(jnp.asarray(x0)) ** 2))(m)
  assert all(bool(jnp.all(jnp.isfinite(t))) for t in jax.tree.leaves(g))
  mb = LowRankCrossNet(n, layers, r, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  assert mb(jnp.asarray(x0)).dtype == jnp.bfloat16 and mb.v[0].kernel[...].dtype == jnp.float32
