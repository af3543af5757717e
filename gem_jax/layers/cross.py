"""DCNv2 low-rank cross network (arXiv 2008.13535; TorchRec `LowRankCrossNet`).

  x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l,   V_l: r x N, W_l: N x r, b_l: N

per example, for l = 0..L-1; x_0 is the flattened input of width N.

Two ways to apply W_l V_l, the same function of the same parameters:
  low rank:  W_l (V_l x)        forward 4 N r FLOPs per example, training 12 N r;
  product:   (W_l V_l) x        U_l = W_l V_l (N x N) formed once per batch: forward
                                2 N^2 per example, training 6 N^2, plus 6 N^2 r per batch
                                (U_l, and dV_l, dW_l from dU_l in the backward).
The product form does fewer FLOPs when r > N / 2 (e.g. TorchRec's DLRM_DCN default,
N = 576, r = 512: 0.56x in the batch-sized matmuls), and the low-rank one otherwise;
`form='auto'` picks by that rule. Both round one intermediate to the compute dtype (V x,
or U); in fp32 they agree to rounding. FLOPs in `gem_jax.flops` count the form in use.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.dense import Dense, matmul
from gem_jax.parallel import sharding

Dtype = Any


class LowRankCrossNet(nnx.Module):
  """(B, N) -> (B, N).

  Args:
    in_features: N.  num_layers: L.  rank: r.
    dtype, param_dtype, fp8: precision policy of the V and W matmuls.
    form: 'low_rank', 'product' or 'auto' (product iff 2 r > N and not fp8; module
      docstring). fp8 runs the low-rank form.
  Parameters: `v[l].kernel` is V_l^T (N, r), `w[l].kernel` is W_l^T (r, N) and
  `w[l].bias` is b_l (initialised to 0, as in TorchRec), whichever the form.
  """

  def __init__(self, in_features: int, num_layers: int, rank: int, *, rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, fp8: bool = False,
               form: str = "auto"):
    self.form = resolve_form(form, in_features, rank, fp8)
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
      x = x0 * self._project(v, w, x) + x  # (B, N)
    return x

  def _project(self, v: Dense, w: Dense, x: jax.Array) -> jax.Array:
    """W V x + b (B, N) in the compute dtype, by the layer's form."""
    if self.form == "low_rank":
      return w(v(x))
    u = matmul(v.kernel[...], w.kernel[...], self.dtype)  # (N, N) fp32: V^T W^T
    y = matmul(x, u, self.dtype) + w.bias[...].astype(jnp.float32)  # (B, N) fp32
    return sharding.constrain_batch(y.astype(self.dtype))


FORMS = ("auto", "low_rank", "product")


def resolve_form(form: str, in_features: int, rank: int, fp8: bool = False) -> str:
  """'low_rank' or 'product' for a cross layer of width N = in_features and rank r."""
  if form not in FORMS:
    raise ValueError(f"cross net form={form!r}: expected one of {', '.join(FORMS)}")
  if form == "product" and fp8:
    raise ValueError("cross net form='product' has no fp8 path: use 'low_rank' or 'auto'")
  if form == "auto":
    return "product" if 2 * rank > in_features and not fp8 else "low_rank"
  return form
