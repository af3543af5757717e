"""Benchmark input made on the device: one jitted call per batch, no host work, no transfer.

  gen = device_batch_fn(spec, batch_size, mesh, plan=plan)   # or the host batch's shardings
  batch = gen(step)            # an int (folded into key(seed)) or a PRNG key
  state, metrics = train_step(state, batch)

`gen` returns a global batch in the batch contract of gem_jax/data/spec.py *as
the jitted train step receives it*, i.e. what `setup.device_putter` makes of a
host batch: ids already through the id policy (int32 rows in [0, rows) of the
feature's table, -1 = padding; the host path's int64 raw ids never reach the
device), every leaf split over the batch axis (`sharding.batch_shardings`: ids
and weights `P(('replica', 'shard'), None)` as `plan.ids_shardings()`, the
rest `P(('replica', 'shard'))`). With `threefry_partitionable` (the jax
default) each device draws only its own rows.

Distributions (B rows, all draws independent):
  dense       float32 (B, n_dense)  standard normal
  ids         pooled feature of bag k: n ~ U{1..k} valid ids left-aligned, then -1
              (bag 1: never padded); sequence item feature: valid at positions < len
              of its stream, -1 after. A valid id is row = (a r + c) mod V of table
              rows V, rank r from the continuous power law on [1, V + 1)
                r = floor(((V+1)^(1-s) - 1) u + 1)^(1/(1-s))) - 1,  u ~ U[0, 1)
              (s = 1: r = floor((V+1)^u) - 1), so P(r = k) ~ (k + 1/2)^-s: Zipf-like,
              exponent s = `zipf`; a = the integer nearest V (sqrt(5) - 1) / 2
              coprime to V and c a per-feature offset make it a bijection of the
              rows that spreads the hot ranks over row-wise shards. zipf = 0:
              uniform, row ~ U{0..V-1}. Ranks are float32: above ~2^24 rows the
              tail is drawn on a grid of a few rows.
  weights     only for the features named in `weights`: U(0, 1] at valid ids, 0 at padding
  seq         per stream of max_len L: len ~ U{0..L} int32 (B,); at positions < len
              action ~ U{1..num_actions-1}, surface ~ U{0..num_surfaces-1},
              dt = cumulative sum of Exponential(mean `dt_mean` s) gaps (most recent
              first); 0 at padding (action, surface int32, dt float32 (B, L))
  domain      int32 (B,) ~ U{0..num_domains-1}
  labels      float32 (B, n_tasks) ~ Bernoulli(`label_rate`); label_mask 1

There is no planted signal (the loss does not fall as on `SyntheticSource`):
this is for timing the step, not for training.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gem_jax.data.spec import DataSpec

_PHI = (math.sqrt(5.0) - 1.0) / 2.0
BATCH_AXES = ("replica", "shard")  # gem_jax.parallel.sharding.RULES['batch']


def table_rows(spec: DataSpec, plan=None) -> dict[str, int]:
  """Rows of the table each sparse feature reads (the plan's tables; no plan: its vocab)."""
  if plan is None:
    return {f.name: int(f.vocab) for f in spec.sparse}
  return {f.name: int(plan.tables[plan.features[f.name].table].rows) for f in spec.sparse}


def _multiplier(rows: int) -> int:
  """The integer nearest rows * (sqrt(5) - 1) / 2 that is coprime to rows (>= 1)."""
  a = max(1, round(rows * _PHI))
  while math.gcd(a, rows) != 1:
    a += 1
  return a % rows if rows > 1 else 0


def _mulmod(x: jax.Array, a: int, m: int) -> jax.Array:
  """(a * x) mod m for uint32 x < m <= 2^31 and a static a < m: double-and-add on a's bits."""
  out = jnp.zeros_like(x)
  m32 = jnp.uint32(m)
  for bit in bin(a)[2:]:
    out = out * jnp.uint32(2)                     # < 2m <= 2^32
    out = jnp.where(out >= m32, out - m32, out)
    if bit == "1":
      out = out + x
      out = jnp.where(out >= m32, out - m32, out)
  return out


def _rows(key: jax.Array, shape: tuple[int, ...], rows: int, zipf: float,
          offset: int) -> jax.Array:
  """int32 row ids in [0, rows) of `shape`: uniform (zipf 0) or Zipf-like (module doc)."""
  if rows > 2**31 - 1:
    raise ValueError(f"table of {rows} rows: int32 ids need rows < 2^31")
  if zipf == 0:
    return jax.random.randint(key, shape, 0, rows, dtype=jnp.int32)
  u = jax.random.uniform(key, shape, jnp.float32)
  if abs(zipf - 1.0) < 1e-6:
    x = jnp.exp(u * np.float32(math.log(rows + 1.0)))
  else:
    e = 1.0 - zipf
    x = (u * np.float32((rows + 1.0) ** e - 1.0) + 1.0) ** np.float32(1.0 / e)
  rank = jnp.clip(jnp.floor(x) - 1, 0, rows - 1).astype(jnp.uint32)
  row = _mulmod(rank, _multiplier(rows), rows) + jnp.uint32(offset % rows)
  row = jnp.where(row >= jnp.uint32(rows), row - jnp.uint32(rows), row)
  return row.astype(jnp.int32)


def generate(key: jax.Array, spec: DataSpec, batch_size: int, rows: Mapping[str, int], *,
             zipf: float = 1.05, label_rate: float = 0.25, weights: Sequence[str] = (),
             dt_mean: float = 3600.0) -> dict:
  """One global batch of `batch_size` rows drawn from `key` (unjitted; see the module doc)."""
  b = batch_size
  stream_of = {}
  for s in spec.sequences:
    for f in s.item_features:
      stream_of.setdefault(f, s)
  k_dense, k_seq, k_ids, k_dom, k_lab = jax.random.split(key, 5)
  seq, seq_valid = {}, {}
  for i, s in enumerate(spec.sequences):
    k_len, k_act, k_surf, k_dt = jax.random.split(jax.random.fold_in(k_seq, i), 4)
    L = s.max_len
    length = jax.random.randint(k_len, (b,), 0, L + 1, dtype=jnp.int32)          # (B,)
    valid = jnp.arange(L, dtype=jnp.int32)[None] < length[:, None]               # (B, L)
    action = jax.random.randint(k_act, (b, L), 1, max(2, s.num_actions), dtype=jnp.int32)
    surface = jax.random.randint(k_surf, (b, L), 0, max(1, s.num_surfaces), dtype=jnp.int32)
    gaps = jax.random.exponential(k_dt, (b, L), jnp.float32) * np.float32(dt_mean)
    seq[s.name] = {
        "len": length,
        "action": jnp.where(valid, action, 0),                                   # (B, L)
        "surface": jnp.where(valid, surface, 0),                                 # (B, L)
        "dt": jnp.where(valid, jnp.cumsum(gaps, axis=1), 0.0),                   # (B, L)
    }
    seq_valid[s.name] = valid
  ids, wts = {}, {}
  for i, f in enumerate(spec.sparse):
    k_id, k_n, k_w = jax.random.split(jax.random.fold_in(k_ids, i), 3)
    if f.name in stream_of:
      s = stream_of[f.name]
      valid = seq_valid[s.name]                                                  # (B, L)
    elif f.bag > 1:
      n = jax.random.randint(k_n, (b,), 1, f.bag + 1, dtype=jnp.int32)           # (B,)
      valid = jnp.arange(f.bag, dtype=jnp.int32)[None] < n[:, None]              # (B, bag)
    else:
      valid = jnp.ones((b, 1), bool)                                             # (B, 1)
    r = _rows(k_id, valid.shape, rows[f.name], zipf, (i + 1) * 0x9E3779B1)
    ids[f.name] = jnp.where(valid, r, -1)                                        # (B, bag)
    if f.name in weights:
      w = 1.0 - jax.random.uniform(k_w, valid.shape, jnp.float32)                # (0, 1]
      wts[f.name] = jnp.where(valid, w, 0.0)
  t = len(spec.tasks)
  batch = {
      "dense": jax.random.normal(k_dense, (b, spec.n_dense), jnp.float32),       # (B, n_dense)
      "ids": ids,
      "seq": seq,
      "domain": jax.random.randint(k_dom, (b,), 0, max(1, spec.num_domains),
                                   dtype=jnp.int32),                             # (B,)
      "labels": jax.random.bernoulli(k_lab, label_rate, (b, t)).astype(jnp.float32),
      "label_mask": jnp.ones((b, t), jnp.float32),                               # (B, T)
  }
  if weights:
    batch["weights"] = wts
  return batch


def _as_key(key, seed: int) -> jax.Array:
  """A typed PRNG key from a key (typed or raw uint32 (2,)) or an integer step."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  if key.dtype == jnp.uint32 and key.shape == (2,):
    return jax.random.wrap_key_data(key)
  if key.shape == () and jnp.issubdtype(key.dtype, jnp.integer):
    return jax.random.fold_in(jax.random.key(seed), key)
  raise TypeError(f"expected a PRNG key or an integer step, got {key.dtype}{key.shape}")


def device_batch_fn(spec: DataSpec, batch_size: int, mesh_or_shardings: Mesh | Any, *,
                    plan=None, seed: int = 0, zipf: float = 1.05, label_rate: float = 0.25,
                    weights: Sequence[str] = (), dt_mean: float = 3600.0
                    ) -> Callable[[Any], dict]:
  """A jitted `key -> global batch` generating on the device (see the module doc).

  Args:
    spec: the data's features (the batch contract).
    batch_size: global rows B (a multiple of the mesh size).
    mesh_or_shardings: a ('replica', 'shard') Mesh (shardings as `device_putter`
      gives them), or a pytree of shardings of the batch (e.g. those of a host
      batch put on the mesh), used as the `out_shardings`.
    plan: the embedding plan: its tables' rows bound the ids (None: each
      feature's vocab) and its `ids_shardings()` place ids and weights.
    seed: the key an integer step is folded into (`gen(i)` = `gen(fold_in(key(seed), i))`).
    zipf: exponent s of the id ranks; 0 = uniform ids.
    label_rate: P(label = 1) of every task.
    weights: features that get per-id weights (default none, like every source).
    dt_mean: mean seconds between two events of a stream.
  Returns:
    `gen(key)`; `key` a PRNG key (typed or raw uint32 (2,)) or an integer step.
    The same key gives the same batch. Every process passes the same key.
  """
  unknown = set(weights) - {f.name for f in spec.sparse}
  if unknown:
    raise ValueError(f"weights for unknown features {sorted(unknown)}")
  rows = table_rows(spec, plan)
  kw = dict(zipf=float(zipf), label_rate=float(label_rate), weights=tuple(weights),
            dt_mean=float(dt_mean))

  def body(key):
    return generate(_as_key(key, seed), spec, batch_size, rows, **kw)

  if isinstance(mesh_or_shardings, Mesh):
    mesh = mesh_or_shardings
    if batch_size % mesh.size:
      raise ValueError(f"global batch {batch_size} is not divisible by the {mesh.size} devices")
    shardings = batch_shardings(jax.eval_shape(body, jax.random.key(0)), mesh, plan)
  else:
    shardings = mesh_or_shardings
  return jax.jit(body, out_shardings=shardings)


def batch_shardings(batch, mesh: Mesh, plan=None):
  """`sharding.batch_shardings(batch, mesh, plan.ids_shardings())`, the host path's: every
  leaf split on its leading axis, ids and weights per feature `P(batch, None)`."""
  b = NamedSharding(mesh, P(BATCH_AXES))
  ids_sh = plan.ids_shardings() if plan is not None else {}
  out = jax.tree.map(lambda _: b, batch)
  for key in ("ids", "weights"):
    if key in batch:
      out[key] = {f: ids_sh.get(f, NamedSharding(mesh, P(BATCH_AXES, None))) for f in batch[key]}
  return out


def differences(batch, like) -> list[str]:
  """Where two batches (arrays or ShapeDtypeStructs) differ in structure, shape or dtype."""
  fa, ta = jax.tree_util.tree_flatten_with_path(batch)
  fb, tb = jax.tree_util.tree_flatten_with_path(like)
  if ta != tb:
    return [f"tree structure {ta} != {tb}"]
  out = []
  for (path, a), (_, b) in zip(fa, fb):
    name = jax.tree_util.keystr(path)
    if (tuple(a.shape), jnp.dtype(a.dtype)) != (tuple(b.shape), jnp.dtype(b.dtype)):
      out.append(f"{name}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
  return out
