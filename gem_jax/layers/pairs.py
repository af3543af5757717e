"""The dot-product interaction: <z_i, z_j> for chosen pairs of tokens (DLRM, FwFM, Wukong's
every-pair FM, GEM's trunk pairs all use it).

  upper_pairs(n)            -> (rows, cols) of the strict upper triangle, i < j, row-major
  dot_pairs(z, rows, cols)  z (B, F, D) -> (B, P) fp32, P = len(rows)

Example: n = 3 tokens give the pairs (0, 1), (0, 2), (1, 2), so dot_pairs(z, *upper_pairs(3))
is [<z_0, z_1>, <z_0, z_2>, <z_1, z_2>] per example.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


# In bf16, up to this many tokens the backward's (G + G^T) Z is F multiply-adds in one
# XLA:CPU loop fusion instead of a batched dot: 0.78 vs 1.97 ms at B = 4096, F = 9, D = 64;
# even at F = 16; 1.9x slower at F = 32. In fp32 the dot is as fast (dlrm_peer step A/B).
_UNROLL_MAX_TOKENS = 16


def upper_pairs(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(rows, cols) of every pair i < j of n tokens, row-major (static, hashable)."""
  iu = np.triu_indices(n, k=1)
  return tuple(int(i) for i in iu[0]), tuple(int(j) for j in iu[1])


def _pair_selection(num_rows: int, rows: tuple[int, ...], cols: tuple[int, ...]) -> np.ndarray:
  """S (P, F*F): S[p, rows[p] * F + cols[p]] = 1."""
  s = np.zeros((len(rows), num_rows * num_rows), np.float32)
  s[np.arange(len(rows)), np.asarray(rows) * num_rows + np.asarray(cols)] = 1.0
  return s


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def dot_pairs(z: jax.Array, rows: tuple[int, ...], cols: tuple[int, ...]) -> jax.Array:
  """<z_i, z_j> for the pairs (i, j) = (rows[p], cols[p]): z (B, F, D) -> (B, P), fp32.

  Forward: zz = Z Z^T (B, F, F), then pairs = flatten(zz) S^T with the 0/1 selection
  S (P, F*F) (a matmul, not a gather). Backward, with G (B, F, F) the pair gradients
  put back in place (g S) and symmetrized: dz = (G + G^T) Z, one batched matmul, or in
  bf16 with F <= 16, F broadcast multiply-adds (faster on XLA:CPU than a 9 x 9 x 64 dot).
  Autodiff would emit a scatter-add and a batched dot contracting a non-minor axis,
  both slow on XLA:CPU (4-5 ms of the dlrm_peer step at batch 4096).
  """
  zz = jnp.einsum("bid,bjd->bij", z, z, preferred_element_type=jnp.float32)  # (B, F, F)
  sel = _pair_selection(z.shape[1], rows, cols)
  return jnp.dot(zz.reshape(z.shape[0], -1), sel.T,
                 precision=jax.lax.Precision.HIGHEST)  # (B, P)


def _pairs_fwd(z, rows, cols):
  return dot_pairs(z, rows, cols), z


def _pairs_bwd(rows, cols, z, g):
  b, f, _ = z.shape
  sel = _pair_selection(f, rows, cols)
  gm = jnp.dot(g, sel, precision=jax.lax.Precision.HIGHEST).reshape(b, f, f)  # (B, F, F)
  gm = (gm + jnp.swapaxes(gm, 1, 2)).astype(z.dtype)
  if f <= _UNROLL_MAX_TOKENS and z.dtype.itemsize < 4:  # dz = sum_j G[:, :, j] z_j, one loop
    zf = z.astype(jnp.float32)
    dz = sum(gm[:, :, j, None].astype(jnp.float32) * zf[:, None, j, :] for j in range(f))
  else:
    dz = jnp.einsum("bij,bjd->bid", gm, z, preferred_element_type=jnp.float32)  # (B, F, D)
  return (dz.astype(z.dtype),)


dot_pairs.defvjp(_pairs_fwd, _pairs_bwd)
