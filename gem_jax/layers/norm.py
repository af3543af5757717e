"""Normalization layers of the sequence blocks, computed in fp32.

Both follow the precision policy of `gem_jax.layers.dense`: parameters in
`param_dtype`, statistics and the normalization itself in fp32, output cast to
the compute `dtype`. Parameters carry the logical axis name 'norm' (never
sharded: they are tiny).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.dense import param

Dtype = Any


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale over the last axis.

  x: (..., D) -> (..., D) in `dtype`; scale (D,) initialized to ones.
  Used for QK-norm (D = head dim) and available as a cheap pre-norm.

  Args:
    dim: normalized width D.  rngs: `nnx.Rngs`.  eps: default 1e-6.
    dtype: output dtype (default float32; statistics in fp32).
    param_dtype: scale dtype (default float32).
  """

  def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    self.eps, self.dtype = eps, dtype
    self.scale = param(rngs, nnx.initializers.ones_init(), (dim,), param_dtype, ("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # (..., 1)
    y = x32 * jax.lax.rsqrt(ms + self.eps) * self.scale[...].astype(jnp.float32)
    return y.astype(self.dtype)


class LayerNorm(nnx.Module):
  """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis.

  x: (..., D) -> (..., D) in `dtype`; scale (D,) ones, bias (D,) zeros.

  Args:
    dim: normalized width D.  rngs: `nnx.Rngs`.  eps: default 1e-6.
    dtype: output dtype (default float32; statistics in fp32).
    param_dtype: scale / bias dtype (default float32).
  """

  def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    self.eps, self.dtype = eps, dtype
    self.scale = param(rngs, nnx.initializers.ones_init(), (dim,), param_dtype, ("norm",))
    self.bias = param(rngs, nnx.initializers.zeros_init(), (dim,), param_dtype, ("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)  # (..., 1)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)  # (..., 1)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)
