"""Sparse optimizers: row-gradient deduplication and in-place row updates.

All functions work on one device's local buffer and a list of (row, gradient)
pairs; rows < 0 are ignored. Slots are gathered, updated in fp32 and scattered
back; fp32 weights get one scatter-add of the step (`mode='drop'` for the unused
dedup slots). On a donated buffer XLA updates in place, so the cost scales with
the batch, not the table.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gem_jax.embedding.config import SparseOptimizerConfig

_BIG = jnp.iinfo(jnp.int32).max


def distinct_rows(flat, fill):
  """int32 (n,) -> (distinct values ascending (n,), `fill` padded; inverse (n,): position
  of each value in them; _BIG in `flat` only with fill = _BIG) = `jnp.unique(flat, size=n,
  fill_value=fill, return_inverse=True)`, by two sorts of one int32 operand and a binary
  search: XLA:CPU sorts a single operand without calling a comparator, where
  `jnp.unique` sorts (value, index) pairs (2,048 ids: ~0.2 ms against ~0.65 ms).
    Example: flat [5, 0, 5, 9] -> sorted [0, 5, 5, 9], first of its run [1, 1, 0, 1],
    uniq = sort([0, 5, _BIG, 9]) = [0, 5, 9, fill], inverse [1, 0, 1, 2]."""
  s = jnp.sort(flat)                                                       # (n,)
  first = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]])
  uniq = jnp.sort(jnp.where(first, s, _BIG))                               # _BIG last
  inv = jnp.searchsorted(uniq, flat).astype(jnp.int32)
  return jnp.where(uniq == _BIG, fill, uniq).astype(jnp.int32), inv


def dedup_rows(rows: jax.Array, grads: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Sums the gradients of duplicate rows.

  Args:
    rows: int32 (n,), -1 = nothing.
    grads: (n, D).
  Returns:
    (unique rows (n,) ascending then -1 padding, summed gradients (n, D), zeros
    at padding). Example: rows [3, -1, 3, 1] -> [1, 3, -1, -1], [g3, g0 + g2, 0, 0].
  """
  n = rows.shape[0]
  uniq, inv = distinct_rows(jnp.where(rows < 0, _BIG, rows).astype(jnp.int32), _BIG)
  summed = jax.ops.segment_sum(grads.astype(jnp.float32), inv, num_segments=n)  # (n, D)
  valid = uniq != _BIG
  return jnp.where(valid, uniq, -1), jnp.where(valid[:, None], summed, 0.0)


def _take(x, idx):
  return jnp.take(x, jnp.maximum(idx, 0), axis=0)


def _put(x, idx, val):
  """x[idx] = val for idx >= 0, in place; idx < 0 dropped."""
  safe = jnp.where(idx >= 0, idx, x.shape[0])
  return x.at[safe].set(val.astype(x.dtype), mode="drop")


def _step_weight(w, idx, delta):
  """w[idx] -= delta. fp32 tables: one scatter-add (a single read-modify-write pass
  over the touched rows, no separate gather); other dtypes: fp32 math, then cast."""
  safe = jnp.where(idx >= 0, idx, w.shape[0])
  if w.dtype == jnp.float32:
    return w.at[safe].add(-delta, mode="drop")
  return w.at[safe].set((_take(w, idx).astype(jnp.float32) - delta).astype(w.dtype), mode="drop")


def apply_rows(opt: SparseOptimizerConfig, slots: dict, uniq: jax.Array, g: jax.Array,
               g2_mean: jax.Array, lr, enabled=None) -> dict:
  """One optimizer step on the unique rows `uniq` of a local buffer.

  Args:
    opt: optimizer config.
    slots: {'weight': (N, D), and 'accumulator' (N,) | 'm', 'v' (N, D), 'step' ()}.
    uniq: int32 (n,) unique local rows, -1 = padding (SGD on fp32 weights also
      takes repeated rows: its scatter-add sums them).
    g: float32 (n, D) summed row gradients.
    g2_mean: float32 (n,) mean over the table's full width of g^2 (row-wise Adagrad).
    lr: learning rate (python float or traced scalar).
    enabled: optional traced bool: False turns the step into a no-op (no row and
      no slot changes, without copying the buffers).
  Returns:
    The updated `slots` dict.
  """
  if enabled is not None:
    uniq = jnp.where(enabled, uniq, -1)
  w = slots["weight"]
  out = dict(slots)
  if opt.kind == "sgd":
    out["weight"] = _step_weight(w, uniq, lr * g)
  elif opt.kind == "rowwise_adagrad":
    s = _take(slots["accumulator"], uniq) + g2_mean               # (n,)
    out["accumulator"] = _put(slots["accumulator"], uniq, s)
    out["weight"] = _step_weight(w, uniq, lr * g / (jnp.sqrt(s)[:, None] + opt.eps))
  elif opt.kind == "adam":
    t = slots["step"] + (1 if enabled is None else enabled.astype(slots["step"].dtype))
    m = opt.beta1 * _take(slots["m"], uniq) + (1 - opt.beta1) * g
    v = opt.beta2 * _take(slots["v"], uniq) + (1 - opt.beta2) * g * g
    tf = t.astype(jnp.float32)
    m_hat = m / (1 - opt.beta1 ** tf)
    v_hat = v / (1 - opt.beta2 ** tf)
    out["m"] = _put(slots["m"], uniq, m)
    out["v"] = _put(slots["v"], uniq, v)
    out["step"] = t
    out["weight"] = _step_weight(w, uniq, lr * m_hat / (jnp.sqrt(v_hat) + opt.eps))
  else:
    raise ValueError(f"unknown sparse optimizer {opt.kind!r}")
  return out
