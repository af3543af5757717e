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


def _grads(m, x):
  return jax.tree.leaves(nnx.grad(lambda m: jnp.mean(jnp.sin(m(x))))(m))


def test_product_form_is_the_low_rank_function():
  """(W V) x and W (V x): same parameters, same outputs and gradients in fp32; in bf16
  both within bf16 rounding of the fp32 result (each rounds one intermediate)."""
  n, r, layers = 24, 16, 3  # 2 r > n: 'auto' picks the product form
  low = LowRankCrossNet(n, layers, r, rngs=nnx.Rngs(0), form="low_rank")
  prod = LowRankCrossNet(n, layers, r, rngs=nnx.Rngs(0))
  assert (low.form, prod.form) == ("low_rank", "product")
  for m in (low, prod):
    for i, w in enumerate(m.w):
      w.bias[...] = jax.random.normal(jax.random.key(10 + i), (n,)) * 0.1
  x = jax.random.normal(jax.random.key(2), (64, n))
  np.testing.assert_allclose(prod(x), low(x), rtol=1e-5, atol=1e-5)
  for a, b in zip(_grads(prod, x), _grads(low, x)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  ref, ref_grads = np.asarray(low(x)), _grads(low, x)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  err = {}  # bf16 against fp32: relative error of the output, then of each gradient leaf
  for form in ("low_rank", "product"):
    mb = LowRankCrossNet(n, layers, r, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, form=form)
    nnx.update(mb, nnx.state(low))
    yb = mb(x)
    assert yb.dtype == jnp.bfloat16
    grads = _grads(mb, x)
    assert all(a.dtype == jnp.float32 for a in grads)  # fp32 master weights, fp32 gradients
    err[form] = [rel(yb.astype(jnp.float32), ref)] + [rel(a, b) for a, b in zip(grads,
                                                                              ref_grads)]
  # the low-rank form's own bf16 error (output 0.6 %, gradients 4-9 % here) is the
  # yardstick for the product's
  assert err["low_rank"][0] < 0.02 and max(err["low_rank"]) < 0.15
  for p, q in zip(err["product"], err["low_rank"]):
    assert p < 1.25 * q + 0.01, err


def test_form_rule_and_errors():
  from gem_jax.layers.cross import resolve_form  # pylint: disable=import-outside-toplevel
  assert resolve_form("auto", 576, 512) == "product"      # TorchRec's DLRM_DCN default
  assert resolve_form("auto", 3456, 512) == "low_rank"    # MLPerf DLRM-DCNv2
  assert resolve_form("auto", 576, 512, fp8=True) == "low_rank"
  assert resolve_form("low_rank", 576, 512) == "low_rank"
  with np.testing.assert_raises_regex(ValueError, "expected one of auto, low_rank, product"):
    resolve_form("full", 576, 512)
  with np.testing.assert_raises_regex(ValueError, "no fp8 path"):
    resolve_form("product", 576, 512, fp8=True)
