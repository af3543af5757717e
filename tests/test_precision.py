"""Precision policy on the tiny GEM: bf16 vs fp32 forward, fp8 training vs bf16 training."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gem_jax.layers.heads import masked_multitask_bce
from gem_jax.models import GEM, get_config, random_inputs, reference_spec

SPEC = reference_spec(n_dense=5, n_sparse=4, streams=1, max_len=8, item_features=1)
B = 16


def _setup(**kw):
  cfg = get_config("tiny", **kw)
  fd = {f.name: cfg.d_model for f in SPEC.sparse}
  return cfg, fd, GEM(cfg, SPEC, fd, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def data():
  fd = {f.name: 64 for f in SPEC.sparse}
  x = random_inputs(SPEC, fd, B, seed=0)
  y = np.random.default_rng(1).integers(0, 2, size=(B, 2)).astype(np.float32)
  return x, y


def test_params_fp32_compute_bf16_logits_fp32(data):
  _, _, m = _setup(dtype="bfloat16")
  assert {str(v[...].dtype) for _, v in nnx.to_flat_state(nnx.state(m, nnx.Param))} == {"float32"}
  logits, aux = nnx.jit(lambda m, x: m(x, return_aux=True))(m, data[0])
  assert logits.dtype == jnp.float32 and aux["trunk"].dtype == jnp.bfloat16


def test_bf16_forward_close_to_fp32(data):
  """Same parameters; bf16 logits within 0.05 absolute (|logit| ~ 0.1-1) of fp32."""
  _, _, m32 = _setup()
  _, _, m16 = _setup(dtype="bfloat16")
  fwd = nnx.jit(lambda m, x: m(x))
  l32, l16 = np.asarray(fwd(m32, data[0])), np.asarray(fwd(m16, data[0]))
  err = np.max(np.abs(l32 - l16))
  print("bf16 vs fp32 max |logit diff|", err)
  assert err < 0.05, err
  assert np.max(np.abs(l32)) > 0.05  # the comparison is not between two near-zero vectors


def _train(m, x, y, steps=5):
  opt = nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def step(m, opt):
    loss, g = nnx.value_and_grad(lambda m: masked_multitask_bce(m(x), y, np.ones_like(y)))(m)
    opt.update(m, g)
    return loss

  return [float(step(m, opt)) for _ in range(steps)]


def test_fp8_path_runs_and_tracks_bf16(data):
  """5 Adam steps: the fp8 run's losses stay within 5% (relative) of the bf16 run's.

  e4m3 keeps 3 mantissa bits (~6% relative rounding per operand); measured gap ~3% at step 5.
  """
  x, y = data
  _, _, m_bf16 = _setup(dtype="bfloat16", num_blocks=1)
  _, _, m_fp8 = _setup(dtype="bfloat16", fp8=True, num_blocks=1)
  hlo = jax.jit(lambda s, x: nnx.merge(nnx.graphdef(m_fp8), s)(x)).lower(
      nnx.state(m_fp8), x).as_text()
  assert "f8e4m3fn" in hlo.lower()  # the fp8 matmuls are really in the graph
  a, b = _train(m_bf16, x, y), _train(m_fp8, x, y)
  print("bf16 losses", a, "fp8 losses", b)
  assert all(np.isfinite(b))
  np.testing.assert_allclose(b, a, rtol=0.05)
  assert b[-1] < b[0]  # and it trains


# ----------------------------------------------------- row-major bf16 backward --

def _grads(fn, x, w, dtype):
  loss = lambda x, w: jnp.sum(jnp.sin(fn(x, w, dtype).astype(jnp.float32)))
  return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


def _plain(x, w, dtype):
  return jnp.einsum("...k,kn->...n", x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32)


@pytest.mark.parametrize("n", [24, 12])  # dW as x^T g, and as (g^T x)^T when 2 N <= K
def test_row_major_matmul_matches_autodiff(n):
  """Same forward; fp32 gradients equal autodiff's; in bf16 its gradients are no
  further from the fp32 ones than autodiff's bf16 gradients are, and dW stays fp32."""
  from gem_jax.layers.dense import row_major_matmul
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(64, 3, 40)), jnp.float32)   # (B, L, K): leading dims flattened
  w = jnp.asarray(rng.normal(size=(40, n)) / 6, jnp.float32)
  np.testing.assert_array_equal(row_major_matmul(x, w, jnp.float32), _plain(x, w, jnp.float32))
  ref = _grads(_plain, x, w, jnp.float32)
  for got, want in zip(_grads(row_major_matmul, x, w, jnp.float32), ref):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  _assert_bf16_grads_as_good_as_autodiff(row_major_matmul, _plain, x, w, ref)


def _assert_bf16_grads_as_good_as_autodiff(fn, plain, x, w, ref):
  """fn's bf16 gradients: no further from the fp32 ones than autodiff's bf16 gradients
  (1.5x, plus 0.1 % of the largest), under 2 % of the largest, and dW in fp32."""
  ours = _grads(fn, x, w, jnp.bfloat16)
  autodiff = _grads(plain, x, w, jnp.bfloat16)
  assert ours[1].dtype == jnp.float32
  for o, a, r in zip(ours, autodiff, ref):
    err_o, err_a = (float(jnp.max(jnp.abs(v.astype(jnp.float32) - r))) for v in (o, a))
    scale = float(jnp.max(jnp.abs(r)))
    assert err_o <= 1.5 * err_a + 1e-3 * scale, (err_o, err_a)
    assert err_o < 0.02 * scale, (err_o, scale)


@pytest.mark.parametrize("n", [96, 64])  # dW as x^T g, and as (g^T x)^T when 2 N <= K
def test_row_major_backward_keeps_bf16_dots_off_fp32_eigen(n):
  """The point of the rewrite (XLA:CPU): autodiff's bf16 backward has fp32 `dot`s
  (bf16 upcast to Eigen); with row-major operands none is left, and the step runs."""
  from gem_jax.layers.dense import row_major_matmul
  x = jnp.ones((512, 128), jnp.bfloat16)
  w = jnp.ones((128, n), jnp.float32)

  def grad(fn):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w, jnp.bfloat16)), argnums=(0, 1)))

  def hlo(fn):  # the entry computation: library calls are fusions, Eigen dots are `dot`s
    return grad(fn).lower(x, w).compile().as_text().split("ENTRY")[1]

  fp32_dot = r"= f32\[\d+,\d+\]\{[01],[01]\} dot\("
  assert re.search(fp32_dot, hlo(_plain)), "autodiff no longer upcasts: rewrite may be moot"
  assert not re.search(fp32_dot, hlo(row_major_matmul))
  dx, dw = grad(row_major_matmul)(x, w)  # a bf16 `dot` left to XLA's DotThunk fails here
  np.testing.assert_array_equal(dw, np.full((128, n), 512.0, np.float32))


def test_dense_auto_rule_and_override():
  from gem_jax.layers import dense
  assert dense.use_row_major_backward(jnp.bfloat16) == (jax.default_backend() == "cpu")
  assert not dense.use_row_major_backward(jnp.float32)
  with dense.row_major_backward(False):
    assert not dense.use_row_major_backward(jnp.bfloat16)
  with dense.row_major_backward(True):
    assert dense.use_row_major_backward(jnp.float32)


@pytest.mark.parametrize("kind", ["row_major_matmul", "lowp_einsum"])
def test_bf16_backward_sharded_matches_one_device(kind):
  """Batch-split x and an FSDP-split w on a 2 x 4 mesh: same gradients as unsharded
  (the custom backward, and row-major's layout constraints, compose with the SPMD
  partitioner)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from gem_jax.layers import dense
  from gem_jax.parallel.mesh import make_mesh
  mesh = make_mesh((2, 4))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(32, 48)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(48, 40)) / 7, jnp.float32)
  mm = {"row_major_matmul": dense.row_major_matmul,
        "lowp_einsum": lambda x, w, dt: dense.lowp_einsum("bk,kn->bn", x, w, dt)}[kind]
  loss = lambda x, w: jnp.sum(jnp.sin(mm(x, w, jnp.bfloat16)))
  grad = lambda: jax.jit(jax.grad(loss, argnums=(0, 1)))
  xs = jax.device_put(x, NamedSharding(mesh, P(("replica", "shard"), None)))
  ws = jax.device_put(w, NamedSharding(mesh, P("shard", None)))
  with dense.lowp_backward(True):
    want = grad()(x, w)
    got = grad()(xs, ws)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0,
                               atol=1e-5 * float(jnp.max(jnp.abs(r))))


# ------------------------------------------- backward in the compute dtype (GPU/TPU) --

@pytest.mark.parametrize("spec,a_shape,b_shape", [
    ("...k,kn->...n", (64, 3, 40), (40, 24)),      # Dense: activations x fp32 weight
    ("bld,bmd->blm", (8, 12, 32), (8, 5, 32)),     # two activations, a batch axis
    ("...hqd,...hkd->...hqk", (4, 3, 2, 12, 16), (4, 3, 2, 10, 16)),  # attention, 3 batch axes
])
def test_lowp_einsum_matches_autodiff(spec, a_shape, b_shape):
  """Same forward; fp32 gradients equal autodiff's (rule forced on in fp32); bf16
  gradients as good as autodiff's, the fp32 operand's in fp32."""
  from gem_jax.layers import dense
  rng = np.random.default_rng(2)
  a = jnp.asarray(rng.normal(size=a_shape), jnp.float32)
  b = jnp.asarray(rng.normal(size=b_shape) / 6, jnp.float32)
  plain = lambda a, b, dt: jnp.einsum(spec, a.astype(dt), b.astype(dt),
                                      preferred_element_type=jnp.float32)
  ours = lambda a, b, dt: dense.lowp_einsum(spec, a, b, dt)
  with dense.lowp_backward(True):
    np.testing.assert_array_equal(ours(a, b, jnp.bfloat16), plain(a, b, jnp.bfloat16))
    ref = _grads(plain, a, b, jnp.float32)
    for got, want in zip(_grads(ours, a, b, jnp.float32), ref):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    _assert_bf16_grads_as_good_as_autodiff(ours, plain, a, b, ref)


@pytest.mark.parametrize("spec,a_shape,b_shape", [
    ("ij,jk", (2, 3), (3, 4)), ("ij,jk->k", (2, 3), (3, 4)), ("ij,jk,kl->il", (2, 3), (3, 4)),
    ("...ij,...jk->...ik", (5, 2, 3), (1, 3, 4)),    # '...' broadcasts
])
def test_lowp_einsum_rejects_specs_it_cannot_transpose(spec, a_shape, b_shape):
  from gem_jax.layers import dense
  with dense.lowp_backward(True), pytest.raises(ValueError, match="einsum spec"):
    dense.lowp_einsum(spec, jnp.ones(a_shape), jnp.ones(b_shape), jnp.bfloat16)


def test_bf16_training_with_lowp_backward_tracks_fp32(data):
  """5 Adam steps of the tiny GEM: bf16 with the bf16 backward (the auto rule) stays
  within 0.005 of the fp32 losses (measured: 7e-4), as bf16 with plain autodiff does."""
  from gem_jax.layers import dense
  x, y = data
  ref = _train(_setup(num_blocks=1)[2], x, y)
  with dense.lowp_backward(True):
    lowp = _train(_setup(dtype="bfloat16", num_blocks=1)[2], x, y)
  with dense.lowp_backward(False):
    autodiff = _train(_setup(dtype="bfloat16", num_blocks=1)[2], x, y)
  print("fp32", ref, "bf16 lowp", lowp, "bf16 autodiff", autodiff)
  assert lowp != autodiff  # the rule changed the program
  np.testing.assert_allclose(lowp, ref, atol=0.005)
  np.testing.assert_allclose(autodiff, ref, atol=0.005)
  assert lowp[-1] < lowp[0]


def test_bf16_backward_of_the_gpu_program_has_no_mixed_dots():
  """The GEM step as GPU/TPU trace it (no CPU row-major rewrite): with the rule on,
  every dot takes two operands of one dtype and bf16 carries >= 99 % of the FLOPs;
  plain autodiff hands fp32 cotangents to the backward dots (fp32 x bf16, which
  XLA upcasts to fp32 matmuls) for about 2/3 of them."""
  from gem_jax.bench.matmul_ceiling import collect_dots
  from gem_jax.layers import dense
  x = random_inputs(SPEC, {f.name: 64 for f in SPEC.sparse}, B, seed=0)
  _, _, m = _setup(dtype="bfloat16", num_blocks=1)
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)

  def loss(p):
    return jnp.sum(nnx.merge(graphdef, p, rest)(x))

  def flop_share(lowp):
    with dense.row_major_backward(False), dense.lowp_backward(lowp):
      dots = collect_dots(jax.make_jaxpr(jax.grad(loss))(params))
    total = sum(c * d.flops for d, c in dots.items())
    mixed = sum(c * d.flops for d, c in dots.items() if d.lhs_dtype != d.rhs_dtype)
    bf16 = sum(c * d.flops for d, c in dots.items() if d.lhs_dtype == d.rhs_dtype == "bfloat16")
    return mixed / total, bf16 / total

  mixed, bf16 = flop_share(True)
  assert mixed == 0 and bf16 >= 0.99, (mixed, bf16)
  mixed_autodiff, _ = flop_share(False)
  assert mixed_autodiff > 0.3, mixed_autodiff


def test_lowp_auto_rule_and_override():
  from gem_jax.layers import dense
  assert dense.use_lowp_backward(jnp.bfloat16)
  assert not dense.use_lowp_backward(jnp.float32)
  with dense.lowp_backward(True):
    assert dense.use_lowp_backward(jnp.float32)
  with dense.lowp_backward(False):
    assert not dense.use_lowp_backward(jnp.bfloat16)
