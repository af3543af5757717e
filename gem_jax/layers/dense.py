"""The one dense projection every gem_jax block uses, with the precision policy.

Precision policy (set once per model, passed down as arguments):
  * parameters are stored in `param_dtype` (fp32 master weights);
  * inputs and weights are cast to `dtype` (bf16 on GPU/TPU; CPU configs choose) for
    the matmul, with fp32 accumulation; the bias is added in fp32, then cast to `dtype`;
  * `fp8=True` runs the forward matmul on per-tensor scaled `float8_e4m3fn`
    operands (current scaling: scale = amax / 448), accumulating in fp32; the
    backward pass uses the unquantized operands in `dtype` (straight-through).
  * bf16 on CPU: `row_major_matmul` writes the backward pass as two row-major
    matmuls so that XLA:CPU runs them in bf16 in its matmul library (see there);
    the weight gradient is then accumulated and returned in fp32.

Parameters carry logical axis names in their `logical_axes` metadata, e.g.
`('embed', 'mlp')`; `gem_jax.parallel.sharding` maps those names onto mesh axes
in one table.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint

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


def _row_major_t(a: jax.Array) -> jax.Array:
  """a (M, N) -> a^T (N, M), materialized row-major (a transpose copy, ~0.3 ms for 4096 x 512)."""
  return with_layout_constraint(a.T, Layout(major_to_minor=(0, 1)))


def matmul(x: jax.Array, w: jax.Array, dtype: Any) -> jax.Array:
  """x @ w with both operands cast to `dtype`, fp32 accumulation and result.
  x: (..., K), w: (K, N) -> (..., N)."""
  return jnp.einsum("...k,kn->...n", x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def row_major_matmul(x: jax.Array, w: jax.Array, dtype: Any) -> jax.Array:
  """x @ w in `dtype` with fp32 accumulation, returned in fp32. x: (..., K), w: (K, N).

  Same value as `matmul`; only the backward pass differs. Autodiff emits
  dW = x^T g as a dot contracting over the leading (batch) axis of both operands,
  and dx = g w^T with a transposed weight. XLA:CPU's matmul library (YNNPACK) takes
  bf16 dots only when both operands are row-major with the lhs contracting axis
  last, so it upcasts those two to an fp32 Eigen contraction (~125 GFLOP/s on two
  Zen 4 cores against ~350 in bf16). Here the backward is
    dx = g @ (w^T)    (..., N) x (N, K)     w^T copied row-major (small)
    dW = (x^T) @ g    (K, M) x (M, N)       x^T copied row-major (M = rows of x)
  and dW is accumulated and returned in fp32 (w's dtype), not rounded to bf16.
  """
  return matmul(x, w, dtype)


def _rm_fwd(x, w, dtype):
  xc = x.astype(dtype)
  return row_major_matmul(x, w, dtype), (xc, w, jnp.zeros((0,), x.dtype))  # last: x's dtype


def _rm_bwd(dtype, res, g):
  xc, w, x_proto = res
  k, n = w.shape
  g = g.astype(dtype)  # (..., N)
  dx = jnp.einsum("...n,nk->...k", g, _row_major_t(w.astype(dtype)),
                  preferred_element_type=jnp.float32)  # (..., K)
  dw = jnp.dot(_row_major_t(xc.reshape(-1, k)), g.reshape(-1, n),
               preferred_element_type=jnp.float32)  # (K, N)
  return dx.astype(x_proto.dtype), dw.astype(w.dtype)


row_major_matmul.defvjp(_rm_fwd, _rm_bwd)

_ROW_MAJOR_BACKWARD: list[bool | None] = [None]  # None: auto (bf16 on CPU)


@contextlib.contextmanager
def row_major_backward(enabled: bool | None) -> Iterator[None]:
  """Forces `row_major_matmul` on (True) or off (False) while tracing; None = auto."""
  prev = _ROW_MAJOR_BACKWARD[0]
  _ROW_MAJOR_BACKWARD[0] = enabled
  try:
    yield
  finally:
    _ROW_MAJOR_BACKWARD[0] = prev


def use_row_major_backward(dtype: Any) -> bool:
  """Auto rule: bf16 compute on the CPU backend (fp32 measured slower with it)."""
  if _ROW_MAJOR_BACKWARD[0] is not None:
    return _ROW_MAJOR_BACKWARD[0]
  return jax.default_backend() == "cpu" and jnp.dtype(dtype) == jnp.bfloat16


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
    if self.fp8:
      y = fp8_matmul(x.astype(self.dtype), self.kernel[...].astype(self.dtype))  # (..., N)
    elif use_row_major_backward(self.dtype):
      y = row_major_matmul(x, self.kernel[...], self.dtype)  # (..., N) fp32
    else:
      y = matmul(x, self.kernel[...], self.dtype)  # (..., N) fp32
    if self.bias is not None:  # added in fp32: its gradient is then an fp32 sum over rows
      y = y.astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    y = y.astype(self.dtype)
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
