"""LinearModel (the logistic-regression baseline) against a float64 numpy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec
from gem_jax.models import MODELS, get_config, random_inputs
from gem_jax.models.linear import LinearModel, linear_flops

B = 6
SPEC = DataSpec(
    n_dense=3,
    sparse=(SparseFeatureSpec("f0", 50), SparseFeatureSpec("f1", 50, bag=3),
            SparseFeatureSpec("hist", 50)),
    sequences=(SequenceStreamSpec("s", max_len=5, item_features=("hist",)),),
    num_domains=2, tasks=("click", "conversion"))
FD = {"f0": 4, "f1": 6, "hist": 4}
K = 3 + 4 + 6 + 4


@pytest.fixture(scope="module")
def model():
  m = LinearModel(get_config("tiny"), SPEC, FD, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)  # non-zero biases so the domain lookup is tested
  m.domain_bias[...] = jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)
  return m


@pytest.fixture(scope="module")
def inputs():
  x = random_inputs(SPEC, FD, B, seed=3, lengths={"s": np.array([0, 1, 5, 3, 2, 5])})
  x["domain"] = np.array([0, 1, 1, 0, 1, 0], np.int32)
  return x


def np_linear(m, x):
  """logits = [dense; f0; f1; masked mean of hist] W + b_dom[domain], in float64."""
  seq = x["seq"]["s"]
  mean = np.zeros((B, 4))
  for b in range(B):
    n = int(seq["mask"][b].sum())
    if n:
      mean[b] = seq["items"]["hist"][b, :n].astype(np.float64).mean(0)
  feats = np.concatenate([x["dense"], x["sparse"]["f0"], x["sparse"]["f1"], mean], 1)
  w = np.asarray(m.linear.kernel[...], np.float64)
  bias = np.asarray(m.domain_bias[...], np.float64)
  return feats @ w + bias[x["domain"]], feats


def test_matches_numpy_reference(model, inputs):
  y, aux = model(inputs, return_aux=True)
  ref, feats = np_linear(model, inputs)
  assert y.shape == (B, 2) and y.dtype == jnp.float32 and model.in_features == K
  np.testing.assert_allclose(np.asarray(aux["trunk"]), feats, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)


def test_padded_events_are_ignored(model, inputs):
  x = jax.tree.map(np.copy, inputs)
  mask = x["seq"]["s"]["mask"]
  x["seq"]["s"]["items"]["hist"][~mask] = 1e3  # garbage in every padded slot
  np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(model(inputs)))


def test_no_feature_interactions(model, inputs):
  """Additive in the features: f(a1, b1) + f(a2, b2) == f(a1, b2) + f(a2, b1)."""
  a_swapped = jax.tree.map(np.copy, inputs)
  a_swapped["sparse"]["f0"] = inputs["sparse"]["f0"][::-1].copy()
  a_swapped["dense"] = inputs["dense"][::-1].copy()
  a_swapped["domain"] = inputs["domain"][::-1].copy()
  a_swapped["seq"] = jax.tree.map(lambda v: v[::-1].copy(), inputs["seq"])
  # rows of a_swapped: (f0, dense, domain, seq) of row B-1-b with f1 of row b.
  y, y_sw = np.asarray(model(inputs), np.float64), np.asarray(model(a_swapped), np.float64)
  lhs = y + y[::-1]
  rhs = y_sw + y_sw[::-1]
  np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=1e-5)
  assert np.abs(y - y_sw).max() > 1e-2  # the swap did change single rows


def test_gradients_are_the_logistic_regression_ones(model, inputs):
  """BCE mean over (B, T): dL/dW = x^T (p - y) / (B T), dL/de_f0 = (p - y) W_f0^T / (B T)."""
  labels = np.random.default_rng(5).integers(0, 2, size=(B, 2)).astype(np.float32)
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(params, sparse):
    m = nnx.merge(graphdef, params)
    logits = m({**inputs, "sparse": sparse})
    return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)

  g_params, g_sparse = jax.grad(loss, argnums=(0, 1))(params, inputs["sparse"])
  ref, feats = np_linear(model, inputs)
  r = (1.0 / (1.0 + np.exp(-ref)) - labels) / labels.size  # (B, T)
  w = np.asarray(model.linear.kernel[...], np.float64)
  np.testing.assert_allclose(np.asarray(g_params["linear"]["kernel"][...]), feats.T @ r,
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(g_sparse["f0"]), r @ w[3:7].T, rtol=1e-4, atol=1e-6)
  gb = np.zeros((2, 2))
  np.add.at(gb, inputs["domain"], r)
  np.testing.assert_allclose(np.asarray(g_params["domain_bias"][...]), gb, rtol=1e-4, atol=1e-6)


def test_registered_and_flops():
  assert MODELS["lr"] is LinearModel
  assert linear_flops(SPEC, FD) == 2 * 17 * 2
