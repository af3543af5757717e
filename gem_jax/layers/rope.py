"""Rotary position embedding (RoPE) for the sequence blocks.

For a head vector x (dh even) at integer position p, split x = [x1, x2]
(halves of size dh/2) and rotate each pair (x1_i, x2_i) by the angle
p * theta_i, theta_i = base^(-2i/dh):

  rope(x, p) = [x1 cos - x2 sin, x2 cos + x1 sin].

Applied to queries and keys, it makes q.k depend only on the position
difference. In gem_jax sequences are most-recent-first, so p = 0 is the newest
event and the phase grows with recency rank. Computed in fp32, returned in
the input dtype. No parameters, 0 FLOPs counted (elementwise).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, head_dim: int, base: float = 10000.0
                ) -> tuple[jax.Array, jax.Array]:
  """cos, sin of p * theta_i.   positions: (..., L) -> two (..., L, dh/2) fp32."""
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
  inv_freq = base ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # (..., L, dh/2)
  return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotate x: (B, L, H, dh) by positions (L,) or (B, L); returns x.dtype."""
  dh = x.shape[-1]
  cos, sin = rope_angles(positions, dh, base)  # (..., L, dh/2)
  cos = cos[..., None, :]  # (..., L, 1, dh/2): broadcast over heads
  sin = sin[..., None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : dh // 2], x32[..., dh // 2:]  # (B, L, H, dh/2)
  y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # (B, L, H, dh)
  return y.astype(x.dtype)
