"""MLP and LayerNorm: numpy references, precision policy, remat, logical axes, plain jax.jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import references as R
from gem_jax.layers.mlp import MLP, LayerNorm, mlp_flops


def _np_mlp(m, x):
  return R.mlp(R.params(m), x, final=m.final_activation, act=m.activation)


def test_mlp_matches_numpy():
  m = MLP(5, [7, 3], rngs=nnx.Rngs(0))
  x = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(m(jnp.asarray(x))), _np_mlp(m, x), rtol=1e-5, atol=1e-6)
  assert mlp_flops(5, [7, 3]) == 2 * (5 * 7 + 7 * 3)


def test_mlp_bf16_compute_fp32_params_and_axes():
  m = MLP(8, [16, 4], rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  y = m(jnp.ones((2, 8)))
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 4)
  assert m.layers[0].kernel[...].dtype == jnp.float32
  assert m.layers[0].kernel.get_metadata()["logical_axes"] == ("embed", "mlp")
  assert m.layers[1].kernel.get_metadata()["logical_axes"] == ("mlp", "embed")


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_mlp_remat_same_grads_inside_plain_jit(remat):
  x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 6)), jnp.float32)
  ref = MLP(6, [8, 2], rngs=nnx.Rngs(3))
  ckpt = MLP(6, [8, 2], rngs=nnx.Rngs(3), remat=remat)

  def grads(m):  # a module captured by a plain jax.jit closure
    g, s = nnx.split(m)
    return jax.jit(jax.grad(lambda s: jnp.sum(nnx.merge(g, s)(x) ** 2)))(s)

  for a, b in zip(jax.tree.leaves(grads(ref)), jax.tree.leaves(grads(ckpt))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  assert jax.jit(lambda v: ckpt(v))(x).shape == (3, 2)  # closure capture works with remat on


def test_layernorm_matches_numpy_and_keeps_dtype():
  ln = LayerNorm(6, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  ln.scale[...] = jnp.arange(1.0, 7.0)
  ln.bias[...] = jnp.full((6,), 0.5)
  x = np.random.default_rng(2).normal(size=(3, 6)).astype(np.float32)
  ref = R.layernorm(x.astype(np.float64), np.arange(1.0, 7.0), 0.5, eps=R.LN_EPS_MLP)
  y = ln(jnp.asarray(x))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2, atol=2e-2)
