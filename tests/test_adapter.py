"""StudentAdapter (identity at init, formula) and the distillation loss."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gem_jax.layers.adapter import StudentAdapter, distillation_loss
from gem_jax.layers.heads import masked_multitask_bce


def test_adapter_identity_at_init_then_formula():
  rng = np.random.default_rng(0)
  zt = rng.normal(size=(4, 2)).astype(np.float32)
  xs = rng.normal(size=(4, 3)).astype(np.float32)
  dom = np.asarray([0, 1, 1, 0])
  m = StudentAdapter(2, 3, 2, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(m(zt, xs, dom)), zt)
  m.scale[...] = jnp.asarray([[1.5, 0.5], [2.0, 1.0]])
  m.shift[...] = jnp.asarray([[0.1, -0.1], [0.3, 0.0]])
  m.mlp.layers[-1].kernel[...] = jnp.ones_like(m.mlp.layers[-1].kernel[...]) * 0.2
  l0, l1 = m.mlp.layers
  f = np.concatenate([zt, xs], -1)
  mlp = np.maximum(f @ np.asarray(l0.kernel[...]) + np.asarray(l0.bias[...]), 0)
  mlp = mlp @ np.asarray(l1.kernel[...]) + np.asarray(l1.bias[...])
  ref = np.asarray(m.scale[...])[dom] * zt + np.asarray(m.shift[...])[dom] + mlp
  np.testing.assert_allclose(np.asarray(m(zt, xs, dom)), ref, rtol=1e-5, atol=1e-6)


def test_adapter_learns_fresh_calibration():
  """A stale teacher that is off by +1 logit: training the adapter on labels removes the bias."""
  rng = np.random.default_rng(1)
  z = rng.normal(size=(512, 1)).astype(np.float32)
  y = (rng.uniform(size=z.shape) < 1 / (1 + np.exp(-z))).astype(np.float32)
  m = StudentAdapter(1, 0, 1, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(m, optax.adam(0.05), wrt=nnx.Param)
  loss = lambda m: masked_multitask_bce(m(z + 1.0), y, jnp.ones_like(y))

  @nnx.jit
  def step(m, opt):
    l, g = nnx.value_and_grad(loss)(m)
    opt.update(m, g)
    return l

  first = float(loss(m))
  for _ in range(100):
    step(m, opt)
  assert float(loss(m)) < first - 0.02
  offset = float(jnp.mean(m(z + 1.0) - z))  # the +1 staleness is corrected
  assert abs(offset) < 0.2, offset


def test_distillation_loss():
  s = jnp.asarray([[0.5, -1.0], [2.0, 0.0]])
  y = jnp.asarray([[1.0, 0.0], [0.0, 1.0]])
  mask = jnp.asarray([[1.0, 0.0], [1.0, 1.0]])
  t = jnp.asarray([[1.0, 1.0], [-2.0, 0.5]])
  p = jax.nn.sigmoid(t)
  soft = jnp.mean(-(p * jnp.log(jax.nn.sigmoid(s)) + (1 - p) * jnp.log(1 - jax.nn.sigmoid(s))))
  ref = masked_multitask_bce(s, y, mask) + 0.3 * soft
  np.testing.assert_allclose(float(distillation_loss(s, y, mask, t, 0.3)), float(ref), rtol=1e-5)
  g = jax.grad(lambda t: distillation_loss(s, y, mask, t, 0.3))(t)
  assert float(jnp.max(jnp.abs(g))) == 0.0  # soft labels are constants
