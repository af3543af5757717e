"""Feature front end: dense floats, pooled sparse embeddings and event sequences -> tokens of width d.

  DenseTokenizer:   dense (B, n_dense) -> MLP -> (B, n_tokens, d)
  SparseProjector:  {f: (B, D_f)} -> (B, n_sparse, d), projected only where D_f != d
  SequenceEmbedder: items {f: (B, L, D_f)}, action, surface, dt, mask
                    -> x (B, L, d) = W_item [e_f]_f + E_act[a] + E_surf[s] + E_time[bucket(dt)],
                       zero at padded events; plus the validity mask and dt.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.dense import Dense, lowp_einsum, param
from gem_jax.layers.mlp import MLP, LayerNorm

Dtype = Any


def lengths_to_mask(lengths: jax.Array, max_len: int) -> jax.Array:
  """valid[b, i] = i < lengths[b]  ->  bool (B, max_len) (events are left-aligned)."""
  return jnp.arange(max_len)[None, :] < lengths[:, None]


def log_time_bucket(dt: jax.Array, num_buckets: int) -> jax.Array:
  """bucket = min(num_buckets - 1, floor(log2(1 + max(dt, 0))))  (dt in seconds) -> int32."""
  b = jnp.floor(jnp.log2(1.0 + jnp.maximum(dt.astype(jnp.float32), 0.0)))
  return jnp.clip(b, 0, num_buckets - 1).astype(jnp.int32)


class DenseTokenizer(nnx.Module):
  """tokens = reshape(MLP(dense), (n_tokens, d)).   (B, n_dense) -> (B, n_tokens, d)

  The MLP has ReLU hidden layers and a linear output of width n_tokens * d.

  Args:
    n_dense: number of dense input features.
    n_tokens, d: number and width of the output tokens.
    hidden: hidden widths of the MLP.
  """

  def __init__(self, n_dense: int, n_tokens: int, d: int, hidden: Sequence[int] = (), *,
               rngs: nnx.Rngs, dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               fp8: bool = False):
    self.n_tokens, self.d = n_tokens, d
    self.mlp = MLP(n_dense, tuple(hidden) + (n_tokens * d,), rngs=rngs, dtype=dtype,
                   param_dtype=param_dtype, fp8=fp8, in_axis=None)

  def __call__(self, dense: jax.Array) -> jax.Array:
    y = self.mlp(dense)  # (B, n_tokens * d)
    return y.reshape(y.shape[:-1] + (self.n_tokens, self.d))  # (B, n_tokens, d)


class SparseProjector(nnx.Module):
  """e'_f = e_f W_g(f) if D_f != d else e_f, stacked in feature order -> (B, n_sparse, d).

  Features sharing a table width D_f form one group whose projections are stored
  as one (G, D_f, d) parameter (one 2-D matmul per feature).

  Args:
    feature_dims: ordered {feature: D_f}; the output token order follows it.
    d: the common token width.
  """

  def __init__(self, feature_dims: Mapping[str, int], d: int, *, rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    self.names = tuple(feature_dims)
    self.d, self.dtype = d, dtype
    groups: dict[int, list[str]] = {}
    for name, dim in feature_dims.items():
      groups.setdefault(int(dim), []).append(name)
    self.groups = tuple((dim, tuple(names)) for dim, names in sorted(groups.items()))
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.proj = nnx.Dict({
        str(dim): param(rngs, init, (len(names), dim, d), param_dtype, ("features", None, "embed"))
        for dim, names in self.groups if dim != d})

  @property
  def num_tokens(self) -> int:
    return len(self.names)

  def __call__(self, sparse: Mapping[str, jax.Array]) -> jax.Array:
    out = {}
    for dim, names in self.groups:
      w = self.proj[str(dim)][...] if dim != self.d else None  # (G, D_f, d), cast in lowp_einsum
      for i, n in enumerate(names):
        x = sparse[n].astype(self.dtype)  # (B, D_f)
        if w is not None:
          x = lowp_einsum("bk,kd->bd", x, w[i], self.dtype).astype(self.dtype)  # (B, d)
        out[n] = x
    return jnp.stack([out[n] for n in self.names], axis=1)  # (B, n_sparse, d)


class SequenceEmbedder(nnx.Module):
  """One event stream -> tokens.

    x_i = LN([e_{f,i}]_f W_item) + E_act[a_i] + E_surf[s_i] + E_time[bucket(dt_i)]
    x_i = 0 where mask_i is False

  with bucket(dt) = min(T-1, floor(log2(1 + dt))) (dt in seconds), T = time_buckets
  (0 disables the time embedding, e.g. when attention uses RoPE instead).

  Args:
    item_dims: ordered {item feature: D_f}; their embeddings are concatenated.
    d: token width.
    num_actions, num_surfaces: vocabulary of the action type and surface ids.
    time_buckets: number of log2 time-delta buckets (0 = none).

  Call: (items {f: (B, L, D_f)}, action int (B, L), surface int (B, L), dt (B, L),
         mask bool (B, L)) -> (x (B, L, d), mask (B, L), dt (B, L) float32).
  """

  def __init__(self, item_dims: Mapping[str, int], d: int, *, num_actions: int,
               num_surfaces: int, time_buckets: int = 32, rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    self.names = tuple(item_dims)
    self.d, self.dtype, self.time_buckets = d, dtype, time_buckets
    self.num_actions, self.num_surfaces = num_actions, num_surfaces
    width = sum(int(v) for v in item_dims.values())
    self.item_proj = Dense(width, d, rngs=rngs, use_bias=False, dtype=dtype,
                           param_dtype=param_dtype, kernel_axes=(None, "embed"))
    self.item_norm = LayerNorm(d, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    emb = nnx.initializers.normal(1.0 / math.sqrt(d))
    self.action_emb = param(rngs, emb, (num_actions, d), param_dtype, ("lookup", "lookup"))
    self.surface_emb = param(rngs, emb, (num_surfaces, d), param_dtype, ("lookup", "lookup"))
    self.time_emb = (param(rngs, emb, (time_buckets, d), param_dtype, ("lookup", "lookup"))
                     if time_buckets > 0 else None)

  def __call__(self, items: Mapping[str, jax.Array], action: jax.Array, surface: jax.Array,
               dt: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    e = jnp.concatenate([items[n].astype(self.dtype) for n in self.names], axis=-1)  # (B, L, sum D_f)
    x = self.item_norm(self.item_proj(e)).astype(jnp.float32)  # (B, L, d)
    x = x + jnp.take(self.action_emb[...], action, axis=0, mode="clip")  # (B, L, d)
    x = x + jnp.take(self.surface_emb[...], surface, axis=0, mode="clip")
    dt = dt.astype(jnp.float32)
    if self.time_emb is not None:
      x = x + jnp.take(self.time_emb[...], log_time_bucket(dt, self.time_buckets), axis=0)
    mask = mask.astype(bool)
    x = jnp.where(mask[..., None], x, 0.0).astype(self.dtype)  # (B, L, d)
    return x, mask, jnp.where(mask, dt, 0.0)
