"""Wukong interaction stack (arXiv 2403.02545) with cross-layer attention (GEM.md §3.1).

One layer on X in R^{n x d} (per example):
  FM:   F = X (X^T Y),  Y in R^{n x k} learned                      -> (n, k)
  FMB:  reshape(MLP(LN(flatten(F))), (n_F, d))                       -> (n_F, d)
  LCB:  W_L X,  W_L in R^{n_L x n}                                   -> (n_L, d)
  out:  LN(concat(FMB(X), LCB(X)) + R X)                             -> (n_F + n_L, d)
with R = I when n = n_F + n_L, else a learned (n_F + n_L) x n projection.

Stack with cross-layer attention [proposal of GEM.md §3.1]: the input of layer
l >= 1 is  sum_j a_{l,j} X_j  over X_0 (projected to n_F + n_L tokens when n
differs) and the outputs X_1..X_l of the earlier layers, with
  a_{l,:} = softmax_j( q_l . mean_n(X_j) / sqrt(d) + c_{l,j} ),
q_l in R^d initialised at 0 and c_{l,:} initialised so that the newest X_l gets
weight 1/2 and the older ones share the other 1/2.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.dense import lowp_einsum, param
from gem_jax.layers.mlp import MLP, LayerNorm, checkpoint_call
from gem_jax.layers.pairs import upper_pairs

Dtype = Any


def _token_init(fan_in: int):
  return nnx.initializers.normal(1.0 / math.sqrt(fan_in))


class FM(nnx.Module):
  """Factorization machine of n tokens, two forms.

  mode='projected' (Wukong's optimized FM): F = X (X^T Y), Y in R^{n x k} learned,
    (B, n, d) -> (B, n, k) (`width` n k). Equals (X X^T) Y, the n x n dot products
    compressed to rank k, in 4 n d k FLOPs instead of 2 n^2 d + 2 n^2 k.
  mode='pairs': <x_i, x_j> for i < j, row-major (the strict upper triangle of X X^T),
    (B, n, d) -> (B, n (n - 1) / 2): every pair on its own, as DLRM's dot interaction;
    2 n^2 d FLOPs.

  Args:
    n: input tokens (Y is (n, k)).
    k: rank of the compressed interactions ('projected' only).
    mode: 'projected' (default) or 'pairs'.
    rngs: `nnx.Rngs` for Y's init, N(0, 1/n).
    dtype: compute dtype (default float32).  param_dtype: Y's dtype (default float32).
  """

  def __init__(self, n: int, k: int, *, rngs: nnx.Rngs, mode: str = "projected",
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    if mode not in ("projected", "pairs"):
      raise ValueError(f"FM mode={mode!r}: expected 'projected' or 'pairs'")
    self.n, self.k, self.mode, self.dtype = n, k, mode, dtype
    self.width = n * k if mode == "projected" else n * (n - 1) // 2
    if mode == "projected":
      self.y = param(rngs, _token_init(n), (n, k), param_dtype, ("tokens", None))
    else:
      rows, cols = upper_pairs(n)
      self.pair_index = tuple(i * n + j for i, j in zip(rows, cols))  # flat index of (i, j)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    if self.mode == "pairs":
      # A gather, not dot_pairs' selection matmul (2 n^2 P FLOPs: O(n^4) at GEM's n0).
      g = lowp_einsum("bnd,bmd->bnm", x, x, self.dtype)  # (B, n, n)
      flat = g.reshape(g.shape[0], -1)  # (B, n n)
      return jnp.take(flat, jnp.asarray(self.pair_index), axis=1).astype(self.dtype)  # (B, P)
    y = self.y[...]  # fp32: lowp_einsum casts it and returns its gradient in fp32
    xty = lowp_einsum("bnd,nk->bdk", x, y, self.dtype)  # (B, d, k)
    f = lowp_einsum("bnd,bdk->bnk", x, xty, self.dtype)  # (B, n, k)
    return f.astype(self.dtype)


class FMB(nnx.Module):
  """FMB(X) = reshape(MLP(LN(flatten(FM(X)))), (n_F, d)).   (B, n, d) -> (B, n_F, d)

  Args:
    n, d: input tokens and width.  k: FM rank.  n_f: output tokens.
    fm: the FM's mode, 'projected' (default) or 'pairs' (`FM`).
    mlp_hidden: hidden widths of the MLP (ReLU); its last layer is linear, n_F * d wide.
    rngs: `nnx.Rngs`.  dtype, param_dtype: compute / parameter dtypes (default float32).
    fp8: fp8 matmuls in the MLP (default False).
  """

  def __init__(self, n: int, d: int, k: int, n_f: int, mlp_hidden: Sequence[int], *,
               rngs: nnx.Rngs, fm: str = "projected", dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, fp8: bool = False):
    self.n_f, self.d = n_f, d
    self.fm = FM(n, k, mode=fm, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    w = self.fm.width
    self.norm = LayerNorm(w, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                          logical_axes=("mlp",))
    self.mlp = MLP(w, tuple(mlp_hidden) + (n_f * d,), rngs=rngs, dtype=dtype,
                   param_dtype=param_dtype, fp8=fp8, in_axis="mlp")

  def __call__(self, x: jax.Array) -> jax.Array:
    f = self.fm(x)  # (B, width): n k ('projected') or n (n - 1) / 2 ('pairs')
    h = self.norm(f.reshape(f.shape[0], -1))  # (B, width)
    return self.mlp(h).reshape(-1, self.n_f, self.d)  # (B, n_F, d)


class LCB(nnx.Module):
  """Linear compress block: W_L X.   (B, n, d) -> (B, n_L, d), W_L (n_L, n).

  Args:
    n: input tokens.  n_l: output tokens.
    rngs: `nnx.Rngs` (W_L ~ N(0, 1/n)).
    dtype, param_dtype: compute / parameter dtypes (default float32).
  """

  def __init__(self, n: int, n_l: int, *, rngs: nnx.Rngs, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32):
    self.dtype = dtype
    self.w = param(rngs, _token_init(n), (n_l, n), param_dtype, (None, "tokens"))

  def __call__(self, x: jax.Array) -> jax.Array:
    return lowp_einsum("ln,bnd->bld", self.w[...], x, self.dtype).astype(self.dtype)  # (B, n_L, d)


class WukongLayer(nnx.Module):
  """X' = LN(concat(FMB(X), LCB(X)) + R X).   (B, n, d) -> (B, n_F + n_L, d)

  R is the identity when n == n_F + n_L, else a learned token projection.
  LayerNorm is per token over d.

  Args:
    n, d: input tokens and width of X, (B, n, d).
    n_f, n_l: tokens out of the FMB and the LCB (keyword-only); the layer outputs
      `n_out = n_f + n_l` tokens (attribute `n_out`).
    k: FM rank.
    mlp_hidden: FMB MLP hidden widths, e.g. (256,).
    fm: the FM's mode, 'projected' (default, X X^T Y) or 'pairs' (every <x_i, x_j>).
    rngs: `nnx.Rngs`.
    dtype, param_dtype: compute / parameter dtypes (default float32).
    fp8: fp8 for the FMB MLP's large matmuls (default False).
    remat: activation checkpointing of the layer: None (default), 'full', 'dots'.
  """

  def __init__(self, n: int, d: int, *, n_f: int, n_l: int, k: int,
               mlp_hidden: Sequence[int], rngs: nnx.Rngs, fm: str = "projected",
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, fp8: bool = False,
               remat: str | None = None):
    self.n_in, self.n_out, self.d = n, n_f + n_l, d
    self.dtype, self.remat = dtype, remat
    self.fmb = FMB(n, d, k, n_f, mlp_hidden, rngs=rngs, fm=fm, dtype=dtype,
                   param_dtype=param_dtype, fp8=fp8)
    self.lcb = LCB(n, n_l, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.res = (param(rngs, _token_init(n), (self.n_out, n), param_dtype, (None, "tokens"))
                if n != self.n_out else None)
    self.norm = LayerNorm(d, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

  def _forward(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    y = jnp.concatenate([self.fmb(x), self.lcb(x)], axis=1)  # (B, n_F + n_L, d)
    if self.res is None:
      r = x
    else:
      r = lowp_einsum("on,bnd->bod", self.res[...], x,
                      self.dtype).astype(self.dtype)  # (B, n_out, d)
    return self.norm(y.astype(jnp.float32) + r.astype(jnp.float32))  # (B, n_out, d)

  def __call__(self, x: jax.Array) -> jax.Array:
    return checkpoint_call(lambda m, y: m._forward(y), self.remat, self, x)


class CrossLayerAttention(nnx.Module):
  """Mixes earlier layer outputs into the next layer's input.

    out_l = sum_j a_{l,j} X_j,  a_{l,:} = softmax_j(q_l . mean_n(X_j) / sqrt(d) + c_{l,j})

  One module serves all `num_layers` mixing points; point l (1-based, l >= 1)
  mixes l + 1 sources. q_l starts at 0 and c_l favours the newest source
  (weight 1/2, the rest share 1/2).
  Call: (sources list of (B, n, d), l) -> (B, n, d).

  Args:
    num_points: mixing points (layers after the first: num_layers - 1).
    d: token width.  rngs: `nnx.Rngs`.
    dtype, param_dtype: output / parameter dtypes (default float32).
  """

  def __init__(self, num_points: int, d: int, *, rngs: nnx.Rngs, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32):
    self.d, self.dtype = d, dtype
    zeros = nnx.initializers.zeros_init()
    self.query = param(rngs, zeros, (max(num_points, 1), d), param_dtype, (None, "embed"))
    c = jnp.zeros((max(num_points, 1), max(num_points, 1) + 1), jnp.float32)
    for l in range(1, num_points + 1):
      c = c.at[l - 1, l].set(math.log(l))  # newest of l + 1 sources: e^{log l} / (l + l) = 1/2
    self.bias = nnx.Param(c.astype(param_dtype), logical_axes=(None, None))

  def __call__(self, sources: Sequence[jax.Array], l: int) -> jax.Array:
    xs = [s.astype(jnp.float32) for s in sources]  # J x (B, n, d)
    pooled = jnp.stack([jnp.mean(x, axis=1) for x in xs], axis=1)  # (B, J, d)
    q = self.query[...][l - 1].astype(jnp.float32)  # (d,)
    scores = pooled @ q / math.sqrt(self.d) + self.bias[...][l - 1, :len(sources)]  # (B, J)
    a = jax.nn.softmax(scores, axis=-1)  # (B, J)
    # A weighted sum of the sources, not einsum('bj,bjnd->bnd') over their stack: its
    # backward stays elementwise in the sources' (B, n, d) layout (the einsum's was an
    # outer product (B, J, n d) transposed back, a 190 ms fusion in `medium`'s CPU step).
    out = a[:, 0, None, None] * xs[0]
    for j in range(1, len(xs)):
      out = out + a[:, j, None, None] * xs[j]  # (B, n, d)
    return out.astype(self.dtype)


class WukongStack(nnx.Module):
  """l Wukong layers, optionally linked by cross-layer attention (module docstring).

  (B, n, d) -> (B, n_out, d),  n_out = n_f + n_l  (attribute `stack.n_out`: size the
  next layer from it, e.g. a head on the flattened (B, n_out * d)).

  Example: `WukongStack(8, 16, num_layers=2, n_f=4, n_l=4, k=4, mlp_hidden=(32,),
  rngs=nnx.Rngs(0))` maps (B, 8, 16) -> (B, 8, 16).

  Args:
    n: input tokens (required).
    d: token width, kept by every layer (required).
    num_layers: Wukong layers l (keyword-only, required).
    n_f: tokens out of each layer's FMB (keyword-only, required).
    n_l: tokens out of each layer's LCB (keyword-only, required).
    k: FM rank (keyword-only, required).
    mlp_hidden: FMB MLP hidden widths, e.g. (256,) (keyword-only, required).
    cross_layer: cross-layer attention between layers (default True); False gives
      the plain published stack.
    fm: every layer's FM, 'projected' (default, X X^T Y) or 'pairs' (`FM`).
    rngs: `nnx.Rngs` (keyword-only, required).
    dtype: compute dtype (default float32; bfloat16 for mixed precision).
    param_dtype: parameter dtype (default float32).
    fp8: fp8 for the FMB MLPs' large matmuls (default False).
    remat: activation checkpointing per layer: None (default), 'full', 'dots'.
  """

  def __init__(self, n: int, d: int, *, num_layers: int, n_f: int, n_l: int, k: int,
               mlp_hidden: Sequence[int], cross_layer: bool = True, fm: str = "projected",
               rngs: nnx.Rngs, dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               fp8: bool = False, remat: str | None = None):
    n_out = n_f + n_l
    self.n_in, self.n_out, self.cross_layer = n, n_out, cross_layer
    self.layers = nnx.List([
        WukongLayer(n if i == 0 else n_out, d, n_f=n_f, n_l=n_l, k=k, mlp_hidden=mlp_hidden,
                    fm=fm, rngs=rngs, dtype=dtype, param_dtype=param_dtype, fp8=fp8, remat=remat)
        for i in range(num_layers)])
    self.cross = (CrossLayerAttention(num_layers - 1, d, rngs=rngs, dtype=dtype,
                                      param_dtype=param_dtype)
                  if cross_layer and num_layers > 1 else None)
    self.x0_proj = (param(rngs, _token_init(n), (n_out, n), param_dtype, (None, "tokens"))
                    if self.cross is not None and n != n_out else None)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    if self.cross is None:
      for layer in self.layers:
        x = layer(x)  # (B, n_out, d)
      return x
    x0 = x
    if self.x0_proj is not None:
      x0 = lowp_einsum("on,bnd->bod", self.x0_proj[...], x,
                       self.dtype).astype(self.dtype)  # (B, n_out, d)
    sources = [x0]
    for l, layer in enumerate(self.layers):
      inp = x if l == 0 else self.cross(sources, l)  # (B, n or n_out, d)
      x = layer(inp)  # (B, n_out, d)
      sources.append(x)
    return x
