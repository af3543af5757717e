"""Multi-layer perceptron and LayerNorm, the dense building blocks of every model.

Both follow the precision policy of `gem_jax.layers.dense`: parameters in
`param_dtype`, matmuls in `dtype` with fp32 accumulation, LayerNorm statistics
in fp32, outputs in `dtype`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.dense import Dense, dense_flops, param

Dtype = Any

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "none": lambda x: x,
}


REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def checkpoint_call(fn: Callable, remat: str | None, module: nnx.Module, *args):
  """fn(module, *args) under activation checkpointing policy `remat`.

  remat: None/'none' (plain call), 'full' (recompute everything in the backward
  pass) or 'dots' (save matmul outputs, recompute the rest). The module is split
  into (graphdef, state) and merged inside `jax.checkpoint`, so this works under
  any transform (plain `jax.jit` closures included), unlike `nnx.remat` on a
  captured module. Forward passes here do not mutate module state.
  """
  if remat in (None, "none"):
    return fn(module, *args)
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat={remat!r}: expected one of none, full, dots")
  graphdef, state = nnx.split(module)

  def pure(state, *args):
    return fn(nnx.merge(graphdef, state), *args)

  return jax.checkpoint(pure, policy=REMAT_POLICIES[remat])(state, *args)


class LayerNorm(nnx.Module):
  """y = (x - mean) / sqrt(var + eps) * scale + bias over the last `axes` dims.

  Statistics in fp32; output in `dtype`. `shape` is the normalized shape (the
  trailing dims of x), `logical_axes` its logical names.   (..., *shape) -> same

  Args:
    shape: normalized trailing shape, an int D or a tuple.  rngs: `nnx.Rngs`.
    eps: default 1e-5.  dtype, param_dtype: output / parameter dtypes (default float32).
    logical_axes: logical axis names of scale / bias (default 'embed' per dim).
    use_bias: learn a bias (default True).
  """

  def __init__(self, shape: int | Sequence[int], *, rngs: nnx.Rngs, eps: float = 1e-5,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               logical_axes: Sequence[str | None] | None = None, use_bias: bool = True):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    axes = tuple(logical_axes) if logical_axes is not None else ("embed",) * len(shape)
    self.shape, self.eps, self.dtype = shape, eps, dtype
    self.scale = param(rngs, nnx.initializers.ones_init(), shape, param_dtype, axes)
    self.bias = (param(rngs, nnx.initializers.zeros_init(), shape, param_dtype, axes)
                 if use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    axes = tuple(range(x.ndim - len(self.shape), x.ndim))
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...].astype(jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


class MLP(nnx.Module):
  """h_{j+1} = act(h_j W_j + b_j) for the hidden layers; the last layer's activation is
  `final_activation` ('none' = linear, as in a logit or projection layer).

  Args:
    in_features: width of the input h_0.
    features: widths of every layer, the last one being the output width.
    activation: name in ACTIVATIONS for the hidden layers.
    final_activation: activation after the last layer ('none' = linear).
    dtype, param_dtype, fp8: precision policy passed to every `Dense`.
    fp8_min_features: layers with min(K, N) below this stay in `dtype` even when
      fp8=True (small matmuls gain nothing from fp8 and lose accuracy).
    in_axis, hidden_axis, out_axis: logical names of the input, hidden and output
      widths (kernels get (in, hidden), (hidden, hidden), ..., (hidden, out)).
    remat: activation checkpointing of the whole MLP (None, 'full', 'dots').
  """

  def __init__(self, in_features: int, features: Sequence[int], *, rngs: nnx.Rngs,
               activation: str = "relu", final_activation: str = "none",
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               fp8: bool = False, fp8_min_features: int = 128, use_bias: bool = True,
               in_axis: str | None = "embed", hidden_axis: str | None = "mlp",
               out_axis: str | None = "embed", remat: str | None = None,
               kernel_init: Callable = nnx.initializers.lecun_normal(),
               last_kernel_init: Callable | None = None):
    if not features:
      raise ValueError("MLP needs at least one layer")
    self.in_features = in_features
    self.features = tuple(int(f) for f in features)
    self.activation, self.final_activation = activation, final_activation
    self.dtype, self.remat = dtype, remat
    dims = (in_features,) + self.features
    layers = []
    for j, (k, n) in enumerate(zip(dims[:-1], dims[1:])):
      last = j == len(self.features) - 1
      axes = (in_axis if j == 0 else hidden_axis, out_axis if last else hidden_axis)
      init = last_kernel_init if (last and last_kernel_init is not None) else kernel_init
      layers.append(Dense(k, n, rngs=rngs, use_bias=use_bias, dtype=dtype,
                          param_dtype=param_dtype, fp8=fp8 and min(k, n) >= fp8_min_features,
                          kernel_axes=axes, kernel_init=init))
    self.layers = nnx.List(layers)

  def _forward(self, x: jax.Array) -> jax.Array:
    act, final = ACTIVATIONS[self.activation], ACTIVATIONS[self.final_activation]
    n = len(self.layers)
    for j, layer in enumerate(self.layers):
      x = layer(x)  # (..., features[j])
      x = final(x) if j == n - 1 else act(x)
    return x

  def __call__(self, x: jax.Array) -> jax.Array:
    return checkpoint_call(lambda m, y: m._forward(y), self.remat, self, x)

  @property
  def out_features(self) -> int:
    return self.features[-1]


def mlp_flops(in_features: int, features: Sequence[int], tokens: int = 1) -> int:
  """Forward FLOPs of an MLP: sum_j 2 h_j h_{j+1} (per token)."""
  dims = (in_features,) + tuple(features)
  return sum(dense_flops(k, n, tokens) for k, n in zip(dims[:-1], dims[1:]))
