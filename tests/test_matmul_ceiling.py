"""Matmul ceiling: which dots a traced step holds, their FLOPs, and the bound they give."""
import jax
import jax.numpy as jnp
import pytest

from gem_jax.bench import matmul_ceiling as mc

B, D_IN, H, D_OUT = 32, 24, 40, 8


def _mlp_loss(params, x):
  h = jnp.tanh(x @ params["w1"])  # (B, H)
  return jnp.sum((h @ params["w2"]) ** 2)  # (B, D_OUT) -> ()


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (D_IN, H)), "w2": jax.random.normal(k2, (H, D_OUT))}


def test_mlp_gradient_dots_are_counted_with_their_flops():
  """Forward 2 dots; backward dW1, dW2 and dx of layer 2 (x is not differentiated): 5."""
  x = jnp.ones((B, D_IN))
  dots = mc.collect_dots(jax.make_jaxpr(jax.jit(jax.grad(_mlp_loss)))(_params(), x))
  assert sum(dots.values()) == 5
  fwd = 2 * B * (D_IN * H + H * D_OUT)
  bwd = 2 * B * (D_IN * H + H * D_OUT) + 2 * B * H * D_OUT
  assert sum(c * s.flops for s, c in dots.items()) == fwd + bwd


def test_batched_dot_flops_and_description():
  s = mc.DotShape((4, 5, 6), (4, 6, 7), "float32", "float32", (((2,), (1,)), ((0,), (0,))),
                  None)
  assert s.flops == 2 * 4 * 5 * 6 * 7
  assert s.describe() == "(4, 5, 6) x (4, 6, 7) float32, contract (2,)x(1,), batch (0,)x(0,)"


def test_scan_body_counts_length_times_and_remat_is_entered():
  w = jnp.ones((16, 16))

  def body(c, _):
    return jax.checkpoint(lambda t: jnp.tanh(t @ w))(c), None

  f = lambda c: jax.lax.scan(body, c, None, length=7)[0]
  dots = mc.collect_dots(jax.make_jaxpr(f)(jnp.ones((4, 16))))
  assert list(dots.values()) == [7]


def test_ceiling_bounds_time_from_the_timed_dots():
  x = jnp.ones((256, D_IN))
  dots = mc.collect_dots(jax.make_jaxpr(jax.grad(_mlp_loss))(_params(), x))
  c = mc.ceiling(dots, model_flops=1e9, peak=1e11, repeats=3)
  assert c["dot_count"] == 5 and c["dot_shapes"] == len(dots)
  assert c["dot_ms"] == pytest.approx(1e3 * sum(t.count * t.seconds for t in c["timings"]))
  assert c["mfu_ceiling"] == pytest.approx(1e9 / (c["dot_ms"] / 1e3) / 1e11)
  assert c["dot_efficiency"] == pytest.approx(c["dot_flops"] / (c["dot_ms"] / 1e3) / 1e11)
  totals = [t.total_s for t in c["timings"]]
  assert totals == sorted(totals, reverse=True) and min(totals) > 0
