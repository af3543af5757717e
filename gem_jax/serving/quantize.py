"""Storage formats of the serving tables: fp32, bf16, int8 row-wise; quantize (numpy) and
gather-dequantize (jnp, inside the exported function).

  float32   {'weight': f32 (rows, D)}                                    4 D bytes a row
  bfloat16  {'weight': bf16 (rows, D)}   round to nearest even           2 D bytes a row
  int8      {'q': int8 (rows, D), 'scale': f32 (rows,)}                  D + 4 bytes a row
            scale_r = max_j |w_rj| / 127 (1 for an all-zero row), q = round(w / scale)

Error per element: bf16 |w - w'| <= 2^-8 |w| (8 significant bits, relative); int8
|w - w'| <= scale_r / 2 = max_j |w_rj| / 254 (absolute, per row). `quantize` also
measures the table's actual max and relative RMS error (written to the manifest).
Gathered rows are dequantized to fp32 before pooling: the model sees fp32 embeddings.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

DTYPES = ("float32", "bfloat16", "int8")


def bytes_per_row(dtype: str, dim: int) -> int:
  """Stored bytes of one table row of width `dim`."""
  return {"float32": 4 * dim, "bfloat16": 2 * dim, "int8": dim + 4}[dtype]


def quantize(w: np.ndarray, dtype: str) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """(stored arrays, error stats) of an fp32 table (rows, D) in `dtype`.

  Stats: 'max_abs' (max |w - w'|), 'rel_rms' (||w - w'|| / ||w||) and 'bound' (the
  format's worst case on this table: bf16 2^-8 max|w|, int8 max_r scale_r / 2).
  """
  w = np.asarray(w, np.float32)
  if dtype == "float32":
    stored, back, bound = {"weight": w}, w, 0.0
  elif dtype == "bfloat16":
    q = w.astype(jnp.bfloat16)
    stored, back, bound = {"weight": q}, q.astype(np.float32), float(np.abs(w).max()) * 2.0**-8
  elif dtype == "int8":
    amax = np.abs(w).max(axis=1)                                          # (rows,)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    stored, back = {"q": q, "scale": scale}, q.astype(np.float32) * scale[:, None]
    bound = float(scale.max()) / 2.0
  else:
    raise ValueError(f"table dtype {dtype!r}: expected one of {DTYPES}")
  err = w.astype(np.float64) - back
  norm = float(np.sqrt(np.sum(np.square(w, dtype=np.float64))))
  return stored, {"max_abs": float(np.abs(err).max(initial=0.0)),
                  "rel_rms": float(np.sqrt(np.sum(err * err)) / norm) if norm else 0.0,
                  "bound": bound}


def gather(table: dict, ids, dtype: str):
  """fp32 rows table[ids] (ids (...) int32, -1: a zero row) -> (..., D), dequantized."""
  valid = ids >= 0
  safe = jnp.where(valid, ids, 0)
  if dtype == "int8":
    rows = (jnp.take(table["q"], safe, axis=0).astype(jnp.float32)
            * jnp.take(table["scale"], safe, axis=0)[..., None])
  else:
    rows = jnp.take(table["weight"], safe, axis=0).astype(jnp.float32)
  return jnp.where(valid[..., None], rows, jnp.zeros((), jnp.float32))
