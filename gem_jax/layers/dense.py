"""The one dense projection every gem_jax block uses, with the precision policy.

Precision policy (set once per model, passed down as arguments):
  * parameters are stored in `param_dtype` (fp32 master weights);
  * inputs and weights are cast to `dtype` (bf16 on GPU/TPU; CPU configs choose) for
    the matmul, with fp32 accumulation; the bias is added in fp32, then cast to `dtype`;
  * `fp8=True` runs the forward matmul on per-tensor scaled `float8_e4m3fn`
    operands (current scaling: scale = amax / 448), accumulating in fp32; the
    backward pass uses the unquantized operands in `dtype` (straight-through).
  * backward in `dtype` too (`lowp_einsum`, every contraction of the model): the
    fp32 cotangent is cast to `dtype` before the two backward dots, which accumulate
    in fp32; gradients come back in each operand's own dtype (fp32 for the master
    weights, unrounded). Plain autodiff would hand fp32 cotangents to the backward
    dots, and XLA upcasts such mixed fp32 x bf16 dots to fp32 matmuls (TF32 at best
    on GPU, fp32 Eigen on CPU);
  * bf16 on CPU: `row_major_matmul` also writes the two backward matmuls with
    row-major operands so that XLA:CPU runs them in its bf16 matmul library.
  * optionally (`weight_grad_dtype`, the trainer's `train.grad_reduce_dtype`) the weight
    gradients of `matmul` leave their dot in bf16: each device's partial sum over its
    rows is rounded once, and the cross-device reduction XLA's partitioner puts on the
    dot's output (reduce-scatter, all-reduce) moves half the bytes; the gradient is
    fp32 again after it. Default: fp32 partial sums and reductions.

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


def _einsum_operands(spec: str) -> tuple[str, str, str]:
  """'bld,bmd->blm' -> ('bld', 'bmd', 'blm'), checked to be transposable.

  Both backward einsums reuse the spec's letters ('out,b->a' and 'a,out->b'), so
  every index of one operand must appear in the other operand or in the output.
  """
  ins, arrow, out = spec.replace(" ", "").partition("->")
  operands = ins.split(",")
  if not arrow or len(operands) != 2:
    raise ValueError(f"einsum spec {spec!r}: expected two operands and an explicit '->'")
  a, b = operands
  for mine, other in ((a, b), (b, a)):
    lost = sorted(set(mine.replace(".", "")) - set(other) - set(out))
    if lost:
      raise ValueError(f"einsum spec {spec!r}: index {lost} is summed within one operand")
  return a, b, out


def lowp_einsum(spec: str, a: jax.Array, b: jax.Array, dtype: Dtype,
                b_grad_dtype: Dtype | None = None) -> jax.Array:
  """einsum(spec, a, b) on operands cast to `dtype`, fp32 accumulation and result.

  Narrower than fp32 (bf16, fp16), the backward dots also run in `dtype`:
    da = einsum('out,b->a', g.astype(dtype), b),   db = einsum('a,out->b', a, g.astype(dtype))
  with fp32 accumulation, returned in a's and b's own dtypes (an fp32 weight gets
  an fp32 gradient). In fp32 (see `use_lowp_backward`) this is plain `jnp.einsum`
  with autodiff. `b_grad_dtype`: the dtype db leaves its dot in (then cast to b's dtype);
  None: fp32.
  """
  if not use_lowp_backward(dtype):
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)
  sa, sb, _ = _einsum_operands(spec)
  ea, eb = _ellipsis_shape(sa, a), _ellipsis_shape(sb, b)
  if ea is not None and eb is not None and ea != eb:
    raise ValueError(f"einsum spec {spec!r}: '...' broadcasts {a.shape} against {b.shape}; "
                     "the backward needs equal '...' shapes")
  return _lowp_einsum(spec, a, b, jnp.dtype(dtype),
                      jnp.dtype(b_grad_dtype or jnp.float32))


def _ellipsis_shape(sub: str, x: jax.Array) -> tuple[int, ...] | None:
  """The dims `x` gives to '...' in its subscripts `sub` (None: no '...')."""
  if "..." not in sub:
    return None
  i = sub.index("...")
  return tuple(x.shape[i:i + x.ndim - (len(sub) - 3)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _lowp_einsum(spec, a, b, dtype, b_grad_dtype):
  return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _lowp_fwd(spec, a, b, dtype, b_grad_dtype):
  ac, bc = a.astype(dtype), b.astype(dtype)
  y = jnp.einsum(spec, ac, bc, preferred_element_type=jnp.float32)
  return y, (ac, bc, jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))  # last: dtypes


def _lowp_bwd(spec, dtype, b_grad_dtype, res, g):
  ac, bc, a_proto, b_proto = res
  sa, sb, out = _einsum_operands(spec)
  g = g.astype(dtype)
  da = jnp.einsum(f"{out},{sb}->{sa}", g, bc, preferred_element_type=jnp.float32)
  db = jnp.einsum(f"{sa},{out}->{sb}", ac, g, preferred_element_type=b_grad_dtype)
  return da.astype(a_proto.dtype), db.astype(b_proto.dtype)


_lowp_einsum.defvjp(_lowp_fwd, _lowp_bwd)


def _row_major_t(a: jax.Array) -> jax.Array:
  """a (M, N) -> a^T (N, M), materialized row-major (a transpose copy, ~0.3 ms for 4096 x 512)."""
  return with_layout_constraint(a.T, Layout(major_to_minor=(0, 1)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def row_major_matmul(x: jax.Array, w: jax.Array, dtype: Any, w_grad_dtype: Any = jnp.float32
                     ) -> jax.Array:
  """x @ w in `dtype` with fp32 accumulation, returned in fp32. x: (..., K), w: (K, N).

  Same value and dtypes as `lowp_einsum('...k,kn->...n', x, w, dtype)`; only the
  operand layouts of the backward differ. Its dW = x^T g is a dot contracting over
  the leading (batch) axis of both operands, and dx = g w^T uses a transposed
  weight. XLA:CPU's matmul library (YNNPACK) takes
  bf16 dots only when both operands are row-major with the lhs contracting axis
  last, so it upcasts those two to an fp32 Eigen contraction (~125 GFLOP/s on two
  Zen 4 cores against ~350 in bf16). Here the backward is
    dx = g @ (w^T)    (..., N) x (N, K)     w^T copied row-major (small)
    dW = (x^T) @ g    (K, M) x (M, N)       x^T copied row-major (M = rows of x)
       = ((g^T) @ x)^T                       when N <= K / 2: the narrower g copied instead
  and dW is accumulated in fp32 and leaves its dot in `w_grad_dtype` (fp32: not rounded),
  returned in w's dtype.
  """
  return jnp.einsum("...k,kn->...n", x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32)


def _rm_fwd(x, w, dtype, w_grad_dtype):
  xc = x.astype(dtype)
  return row_major_matmul(x, w, dtype, w_grad_dtype), (xc, w, jnp.zeros((0,), x.dtype))


def _rm_bwd(dtype, w_grad_dtype, res, g):
  xc, w, x_proto = res
  k, n = w.shape
  g = g.astype(dtype)  # (..., N)
  dx = jnp.einsum("...n,nk->...k", g, _row_major_t(w.astype(dtype)),
                  preferred_element_type=jnp.float32)  # (..., K)
  if 2 * n <= k:  # transpose the narrower batch-tall operand (half or less): dW = (g^T x)^T
    dwt = jnp.dot(_row_major_t(g.reshape(-1, n)), xc.reshape(-1, k),
                  preferred_element_type=w_grad_dtype)  # (N, K)
    dw = _row_major_t(with_layout_constraint(dwt, Layout(major_to_minor=(0, 1))))  # (K, N)
  else:
    dw = jnp.dot(_row_major_t(xc.reshape(-1, k)), g.reshape(-1, n),
                 preferred_element_type=w_grad_dtype)  # (K, N)
  return dx.astype(x_proto.dtype), dw.astype(w.dtype)


row_major_matmul.defvjp(_rm_fwd, _rm_bwd)


def matmul(x: jax.Array, w: jax.Array, dtype: Dtype) -> jax.Array:
  """x @ w under the precision policy: operands in `dtype`, fp32 accumulation and result.

  x: (..., K), w: (K, N) -> (..., N) fp32. The backward runs in `dtype` too
  (`lowp_einsum`), with row-major operands on CPU in bf16 (`row_major_matmul`); dW leaves
  its dot in `weight_grad_dtype`'s dtype (fp32 unless set).
  """
  if use_row_major_backward(dtype):
    return row_major_matmul(x, w, dtype, _WEIGHT_GRAD_DTYPE[0])
  return lowp_einsum("...k,kn->...n", x, w, dtype, _WEIGHT_GRAD_DTYPE[0])


@contextlib.contextmanager
def _forced(cell: list, enabled: bool | None) -> Iterator[None]:
  prev, cell[0] = cell[0], enabled
  try:
    yield
  finally:
    cell[0] = prev


_ROW_MAJOR_BACKWARD: list[bool | None] = [None]  # None: auto (bf16 on CPU)
_LOWP_BACKWARD: list[bool | None] = [None]  # None: auto (narrow dtype)
_WEIGHT_GRAD_DTYPE: list[Any] = [jnp.dtype(jnp.float32)]


def weight_grad_dtype(dtype: Dtype | None):
  """While tracing: the dtype `matmul`'s weight gradients leave their dot in, i.e. the
  dtype of the cross-device reductions XLA's partitioner puts after that dot (None or
  fp32: fp32). Takes effect where the backward runs in a narrow compute dtype
  (`use_lowp_backward`); fp32 compute keeps fp32 weight gradients."""
  return _forced(_WEIGHT_GRAD_DTYPE, jnp.dtype(dtype or jnp.float32))


def row_major_backward(enabled: bool | None):
  """Forces `row_major_matmul` on (True) or off (False) while tracing; None = auto."""
  return _forced(_ROW_MAJOR_BACKWARD, enabled)


def lowp_backward(enabled: bool | None):
  """Forces `lowp_einsum`'s backward in the compute dtype on or off while tracing."""
  return _forced(_LOWP_BACKWARD, enabled)


def use_lowp_backward(dtype: Any) -> bool:
  """Auto rule: compute dtype narrower than fp32, on every backend.

  On XLA:CPU a bf16 x bf16 -> fp32 dot needs its batch axes leading in both
  operands (others fail at run time with UNIMPLEMENTED), which is why attention
  runs head-major; a spec that breaks this must keep the rule off there.
  """
  if _LOWP_BACKWARD[0] is not None:
    return _LOWP_BACKWARD[0]
  return jnp.dtype(dtype).itemsize < 4


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
