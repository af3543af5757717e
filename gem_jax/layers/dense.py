"""The one dense projection every gem_jax block uses, with the precision policy.

Precision policy (set once per model, passed down as arguments):
  * parameters are stored in `param_dtype` (fp32 master weights);
  * inputs and weights are cast to `dtype` (bf16 on GPU/TPU, fp32 on CPU) for the
    matmul, with fp32 accumulation;
  * `fp8=True` runs the forward matmul on per-tensor scaled `float8_e4m3fn`
    operands (current scaling: scale = amax / 448), accumulating in fp32; the
    backward pass uses the unquantized operands in `dtype` (straight-through).

Parameters carry logical axis names in their `logical_axes` metadata, e.g.
`('embed', 'mlp')`; `gem_jax.parallel.sharding` maps those names onto mesh axes
in one table.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.parallel import sharding

Dtype = Any
E4M3_MAX = 448.0


def _quantize_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-tensor current scaling: x ~= q * scale with q in float8_e4m3fn."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
  q = (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn)
  return q, jax.lax.stop_gradient(scale)


@jax.custom_vjp
def fp8_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w with e4m3 operands and fp32 accumulation; result in x.dtype.

  x: (..., K), w: (K, N) -> (..., N).
  """
  qx, sx = _quantize_e4m3(x)
  qw, sw = _quantize_e4m3(w)
  y = jnp.einsum("...k,kn->...n", qx, qw, preferred_element_type=jnp.float32)
  return (y * (sx * sw)).astype(x.dtype)


def _fp8_fwd(x, w):
  return fp8_matmul(x, w), (x, w)


def _fp8_bwd(res, g):
  x, w = res
  g = g.astype(x.dtype)
  dx = jnp.einsum("...n,kn->...k", g, w.astype(x.dtype))
  dw = jnp.einsum("...k,...n->kn", x, g, preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), dw.astype(w.dtype)


fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


def param(rngs: nnx.Rngs, init: Callable, shape, param_dtype: Dtype,
          logical_axes: tuple[str | None, ...]) -> nnx.Param:
  """An nnx.Param with logical axis names for the sharding rules."""
  if len(shape) != len(logical_axes):
    raise ValueError(f"shape {shape} and logical axes {logical_axes} differ in rank")
  return nnx.Param(init(rngs.params(), shape, param_dtype), logical_axes=tuple(logical_axes))


class Dense(nnx.Module):
  """y = x W + b.   x: (..., K) -> (..., N); W: (K, N) in param_dtype.

  Args:
    in_features, out_features: K and N.
    use_bias: add b (N,).
    dtype: compute dtype of the matmul (accumulation is fp32).
    param_dtype: storage dtype of W and b.
    fp8: scaled float8_e4m3fn forward matmul (see module docstring).
    kernel_axes: logical names of W's two axes.
  """

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
               use_bias: bool = True, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, fp8: bool = False,
               kernel_axes: tuple[str | None, str | None] = ("embed", "mlp"),
               kernel_init: Callable = nnx.initializers.lecun_normal(),
               bias_init: Callable = nnx.initializers.zeros_init()):
    self.in_features, self.out_features = in_features, out_features
    self.dtype, self.fp8 = dtype, fp8
    self.kernel = param(rngs, kernel_init, (in_features, out_features), param_dtype, kernel_axes)
    self.bias = (param(rngs, bias_init, (out_features,), param_dtype, kernel_axes[1:])
                 if use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    w = self.kernel[...].astype(self.dtype)
    if self.fp8:
      y = fp8_matmul(x, w)  # (..., N)
    else:
      y = jnp.einsum("...k,kn->...n", x, w,
                     preferred_element_type=jnp.float32).astype(self.dtype)  # (..., N)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return sharding.constrain_batch(y)  # (B, ..., N): batch-split, not split like w


def dense_flops(in_features: int, out_features: int, tokens: int = 1) -> int:
  """Forward FLOPs of a Dense layer over `tokens` rows: 2 * tokens * K * N."""
  return 2 * tokens * in_features * out_features


def maybe_remat(fn: Callable, remat: str | None) -> Callable:
  """Activation checkpointing switch for a block's forward function.

  remat: None/'none' (keep activations), 'full' (recompute everything), or
  'dots' (save matmul outputs without batch dims, recompute the rest:
  `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`).
  Use with nnx modules through `nnx.remat(fn, policy=...)`.
  """
  if remat in (None, "none"):
    return fn
  policies = {
      "full": None,
      "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  }
  if remat not in policies:
    raise ValueError(f"remat={remat!r}: expected one of none, full, dots")
  return nnx.remat(fn, policy=policies[remat])
