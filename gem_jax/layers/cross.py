"""DCNv2 low-rank cross network (arXiv 2008.13535; TorchRec `LowRankCrossNet`).

  x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l,   V_l: r x N, W_l: N x r, b_l: N

per example, for l = 0..L-1; x_0 is the flattened input of width N.
Forward FLOPs per example: L * (4 N r + 4 N)  (the two matmuls 2 N r each, plus
bias add, product and residual, counted as in `gem_jax.flops`).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.dense import Dense

Dtype = Any


class LowRankCrossNet(nnx.Module):
  """(B, N) -> (B, N).

  Args:
    in_features: N.  num_layers: L.  rank: r.
    dtype, param_dtype, fp8: precision policy of the V and W matmuls.
  Parameters: `v[l].kernel` is V_l^T (N, r), `w[l].kernel` is W_l^T (r, N) and
  `w[l].bias` is b_l (initialised to 0, as in TorchRec).
  """

  def __init__(self, in_features: int, num_layers: int, rank: int, *, rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, fp8: bool = False):
    self.dtype = dtype
    init = nnx.initializers.xavier_normal()
    self.v = nnx.List([Dense(in_features, rank, use_bias=False, rngs=rngs, dtype=dtype,
                             param_dtype=param_dtype, fp8=fp8, kernel_axes=("embed", "mlp"),
                             kernel_init=init) for _ in range(num_layers)])
    self.w = nnx.List([Dense(rank, in_features, rngs=rngs, dtype=dtype,
                             param_dtype=param_dtype, fp8=fp8, kernel_axes=("mlp", "embed"),
                             kernel_init=init) for _ in range(num_layers)])

  def __call__(self, x0: jax.Array) -> jax.Array:
    x0 = x0.astype(self.dtype)
    x = x0
    for v, w in zip(self.v, self.w):
      x = x0 * w(v(x)) + x  # (B, N)
    return x
