"""Wukong: FM / FMB / LCB / layer / stack against numpy, cross-layer attention, FLOPs vs XLA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import references as R
from gem_jax import flops
from gem_jax.layers.wukong import FM, LCB, WukongLayer, WukongStack

B, N, D = 3, 6, 8


def _np_layer(m, x):
  """Reference Wukong layer written from the paper's formulas (tests/references.py)."""
  return R.wukong_layer(R.params(m), x)


@pytest.fixture(scope="module")
def x():
  return np.random.default_rng(0).normal(size=(B, N, D)).astype(np.float32)


def test_fm_equals_full_interaction_times_y(x):
  fm = FM(N, 4, rngs=nnx.Rngs(0))
  ref = R.fm(np.asarray(fm.y[...], np.float64), x.astype(np.float64))
  np.testing.assert_allclose(np.asarray(fm(jnp.asarray(x))), ref, rtol=1e-4, atol=1e-4)


def test_lcb(x):
  lcb = LCB(N, 5, rngs=nnx.Rngs(1))
  ref = np.einsum("ln,bnd->bld", np.asarray(lcb.w[...]), x)
  np.testing.assert_allclose(np.asarray(lcb(jnp.asarray(x))), ref, rtol=1e-5, atol=1e-5)


def test_fm_pairs_is_every_dot_product_once(x):
  fm = FM(N, 4, mode="pairs", rngs=nnx.Rngs(0))
  got = np.asarray(fm(jnp.asarray(x)))
  assert got.shape == (B, N * (N - 1) // 2) == (B, fm.width)
  np.testing.assert_allclose(got, R.fm_pairs(x.astype(np.float64)), rtol=1e-5, atol=1e-5)
  assert not nnx.state(fm, nnx.Param)  # no Y: the pairs are not compressed
  i, j = 1, 4  # row-major (i, j), i < j
  col = sum(N - 1 - r for r in range(i)) + (j - i - 1)
  np.testing.assert_allclose(got[:, col], np.sum(x[:, i] * x[:, j], -1), rtol=1e-5)
  with pytest.raises(ValueError, match="mode"):
    FM(N, 4, mode="full", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("n_f,n_l,fm", [(3, 3, "projected"), (4, 2, "projected"),
                                        (5, 4, "projected"), (4, 2, "pairs")])
def test_wukong_layer_matches_reference(x, n_f, n_l, fm):
  m = WukongLayer(N, D, n_f=n_f, n_l=n_l, k=4, mlp_hidden=(16,), fm=fm, rngs=nnx.Rngs(2))
  assert (m.res is None) == (n_f + n_l == N)
  y = m(jnp.asarray(x))
  assert y.shape == (B, n_f + n_l, D) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), _np_layer(m, x.astype(np.float64)), rtol=1e-4,
                             atol=1e-4)


def test_wukong_layer_bf16_fp8_grads():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(B, 16, D)), jnp.float32)
  m = WukongLayer(16, D, n_f=4, n_l=4, k=8, mlp_hidden=(128,), rngs=nnx.Rngs(3),
                  dtype=jnp.bfloat16, fp8=True, remat="dots")
  y = m(x)
  assert y.dtype == jnp.bfloat16 and y.shape == (B, 8, D)
  assert m.fmb.mlp.layers[0].kernel[...].dtype == jnp.float32
  assert m.fmb.mlp.layers[0].fp8  # n k = 128 -> 128: fp8; 128 -> n_F d = 32 stays bf16
  assert not m.fmb.mlp.layers[1].fp8
  g = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)))(m)
  leaves = jax.tree.leaves(g)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in leaves)
  assert all(float(jnp.max(jnp.abs(v))) > 0 for v in leaves)
  assert m.fmb.fm.y.get_metadata()["logical_axes"] == ("tokens", None)


def test_stack_cross_layer_attention_matches_reference(x):
  m = WukongStack(N, D, num_layers=3, n_f=4, n_l=4, k=4, mlp_hidden=(16,), cross_layer=True,
                  rngs=nnx.Rngs(4))
  m.cross.query[...] = jax.random.normal(jax.random.key(0), m.cross.query[...].shape)
  h = R.wukong_stack(R.params(m), x.astype(np.float64))
  np.testing.assert_allclose(np.asarray(m(jnp.asarray(x))), h, rtol=1e-4, atol=1e-4)


def test_cross_layer_initial_weights_favour_newest():
  m = WukongStack(N, D, num_layers=4, n_f=3, n_l=3, k=2, mlp_hidden=(8,), rngs=nnx.Rngs(5))
  for l in range(1, 4):
    a = jax.nn.softmax(m.cross.bias[...][l - 1, :l + 1])
    np.testing.assert_allclose(float(a[l]), 0.5, rtol=1e-6)


def _xla_flops(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_wukong_layer_flops_match_xla():
  n, d, nf, nl, k, h, b = 24, 64, 16, 16, 16, (256, 256), 4
  m = WukongLayer(n, d, n_f=nf, n_l=nl, k=k, mlp_hidden=h, rngs=nnx.Rngs(0))
  g, s = nnx.split(m)
  xla = _xla_flops(lambda s, x: nnx.merge(g, s)(x), s, jnp.ones((b, n, d))) / b
  ana = flops.wukong_layer_flops(n, d, nf, nl, k, h)
  assert abs(xla - ana) / ana < 0.10, (xla, ana)


def test_wukong_108_preset_flops():
  fwd = flops.wukong_stack_flops(384, 160, 8, 192, 192, 192, (16384,) * 3)
  assert 100e9 <= flops.train_flops(fwd) <= 116e9
