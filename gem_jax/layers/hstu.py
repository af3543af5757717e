"""The HSTU layer (Zhai et al. 2024, "Actions Speak Louder than Words"; GEM.md §3.2).

Shapes: B batch, L tokens, D = d_model, H heads, dh = D / H.

  U, V, Q, K = split(silu(W_1 LN(x) + b_1))                 each (B, L, D), heads on D
  A_h = silu(scale Q_h K_h^T + rab_h) / N   on allowed keys, 0 elsewhere   (B, H, L, L)
  y = x + W_2 (LN(concat_h A_h V_h) * U) + b_2               (B, L, D)

rab_h[i, j] = time_table[bucket(dt_i - dt_j), h] + pos_table[min(|p_i - p_j|, P - 1), h]
(each optional; bucket = log2 seconds, `gem_jax.layers.chunked.time_bucket`; p the
positions in the sequence, 0..L-1 unless packed). scale = 1 (HSTU) by default; N = norm_len
(HSTU divides by the maximum sequence length; default: the key length of the call).
Allowed keys: valid keys, the mask ('causal': an event sees itself and older events,
newest-first by default; 'full'; 'block_local') and, for packed rows, the same segment.
The update is zeroed at invalid positions (y_i = x_i there), so padded events never
change a valid output. The attention core is `multihead_attention` (dense, or chunked
with memory linear in L above `impl.dense_max` keys: `AttentionImpl`).

FLOPs (forward, per example): W_1 8 L D^2, attention 4 L Lk_eff D, W_2 2 L D^2:
  10 L D^2 + 4 L Lk_eff D  (`hstu_flops`).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.attention import MASKS, AttentionImpl, multihead_attention
from gem_jax.layers.dense import Dense, param
from gem_jax.layers.norm import LayerNorm

Dtype = Any


def hstu_flops(L: int, d_model: int, *, mask: str = "causal", block_size: int = 64) -> int:
  """Forward FLOPs of `HSTU` on L tokens: 10 L D^2 + 4 L Lk_eff D (Lk_eff: L or b)."""
  if mask == "block_local":
    Lp = -(-L // block_size) * block_size
    return 10 * L * d_model ** 2 + 4 * Lp * block_size * d_model
  return 10 * L * d_model ** 2 + 4 * L * L * d_model


class HSTU(nnx.Module):
  """One HSTU layer (module docstring): pointwise silu attention gated by U.

  Args:
    d_model, num_heads: D and H (D % H == 0).  rngs: `nnx.Rngs`.
    mask: 'causal' (default), 'full' or 'block_local' (block_size b).
    recent_first: sequences are newest-first (direction of 'causal').
    time_buckets: rows of the learned (NB, H) time-delta bias table (0: none).
    pos_buckets: rows P of the learned (P, H) relative-position bias table (0: none).
    scale: logit scale (default 1.0, as in HSTU).
    norm_len: N of silu(.) / N (default None: the key length of each call).
    impl: how the attention core is computed (`AttentionImpl`).
    dtype, param_dtype, fp8: precision policy of `Dense`.

  Call: (x (B, L, D), valid bool (B, L), dt (B, L) seconds or None, *, seg (B, L) int or
  None (packed rows), pos (B, L) int or None, norm (N of the silu, overriding norm_len) or
  None) -> (B, L, D) in dtype.
  """

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs, mask: str = "causal",
               block_size: int = 64, recent_first: bool = True, time_buckets: int = 0,
               pos_buckets: int = 0, scale: float = 1.0, norm_len: int | None = None,
               impl: AttentionImpl = AttentionImpl(), dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, fp8: bool = False):
    if d_model % num_heads:
      raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
    if mask not in MASKS:
      raise ValueError(f"mask={mask!r}: expected one of {MASKS}")
    self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
    self.mask, self.block_size, self.recent_first = mask, block_size, recent_first
    self.scale, self.norm_len, self.impl, self.dtype = scale, norm_len, impl, dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.in_norm = LayerNorm(d_model, **kw)
    self.uvqk = Dense(d_model, 4 * d_model, fp8=fp8, kernel_axes=("embed", "heads"), **kw)
    self.out_norm = LayerNorm(d_model, **kw)
    self.out = Dense(d_model, d_model, fp8=fp8, kernel_axes=("heads", "embed"), **kw)
    zeros = nnx.initializers.zeros_init()
    self.time_bias = (param(rngs, zeros, (time_buckets, num_heads), param_dtype,
                            (None, "heads")) if time_buckets else None)
    self.pos_bias = (param(rngs, zeros, (pos_buckets, num_heads), param_dtype,
                           (None, "heads")) if pos_buckets else None)

  def __call__(self, x: jax.Array, valid: jax.Array, dt: jax.Array | None = None, *,
               seg: jax.Array | None = None, pos: jax.Array | None = None,
               norm: float | None = None) -> jax.Array:
    B, L, D = x.shape
    if self.time_bias is not None and dt is None:
      raise ValueError("time_buckets > 0 needs dt (B, L)")
    x = x.astype(self.dtype)
    h = jax.nn.silu(self.uvqk(self.in_norm(x)))  # (B, L, 4 D)
    u, v, q, k = (t.reshape(B, L, self.num_heads, self.head_dim)
                  for t in jnp.split(h, 4, axis=-1))  # (B, L, H, dh)
    o = multihead_attention(
        q, k, v, valid, score="silu", mask=self.mask, block_size=self.block_size,
        recent_first=self.recent_first, scale=self.scale,
        time_table=None if self.time_bias is None else self.time_bias[...],
        dt_q=dt, dt_k=dt, pos_table=None if self.pos_bias is None else self.pos_bias[...],
        pos_q=pos, pos_k=pos, seg_q=seg, seg_k=seg,
        norm=(norm if norm is not None else
              None if self.norm_len is None else float(self.norm_len)), impl=self.impl,
        dtype=self.dtype)  # (B, L, H, dh)
    gated = self.out_norm(o.reshape(B, L, D)) * u.reshape(B, L, D)  # (B, L, D)
    y = self.out(gated.astype(self.dtype))  # (B, L, D)
    return x + jnp.where(valid[:, :, None], y, jnp.zeros((), y.dtype))  # (B, L, D)
