"""The planner: tables + features + mesh + memory budget -> an `EmbeddingPlan`.

Storage ("buffers", the leaves of the embedding state; S = 'shard' size):
  * table_wise tables of the same (dim, dtype) are packed into one buffer of
    global shape (S * cap, D), split by rows over 'shard': shard j's block holds
    the tables it owns, each at a row offset (`layout.block_offsets`);
  * a row_wise table is a (S * rps, D) buffer, rps = ceil(rows / S), split by rows;
  * a column_wise table is a (rows, S * cps) buffer, cps = ceil(D / S), split by
    columns (the padding columns stay zero);
  * a replicated table is a (rows, D) buffer on every device.
Every buffer is replicated over 'replica'.

Replica sync (`Buffer.sync`, see update.py): how the replicas of a buffer apply
the same update. 'rows': row gradients all-gathered over the replica group
(bytes ~ (G - 1) x rows looked up per device: grows with the group size G,
bounded by the batch); 'dense': the shard's gradient reduce-scattered and
all-gathered (bytes ~ 2 x the local shard: flat in G, bounded by the table);
'none': nothing to sync (G = 1). `replica_sync='auto'` picks, per buffer, the
one that sends fewer bytes, TorchRec's choice for data-parallel tables.

Exchange units (the keys of `rows` and `ctx`): one per table-wise buffer and
pooling class ('pooled' or 'seq'), and one per feature otherwise.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gem_jax.embedding import layout, ragged
from gem_jax.embedding.config import (MAX_ROWS, FeatureConfig, SparseOptimizerConfig,
                                      TableConfig, expected_collision_rate)

BATCH = ("replica", "shard")
REPLICATE_MAX_BYTES = 1 << 18   # 'auto': tables up to 256 KiB (with slots) are replicated
# Owners deduplicate ids before gathering when their local weight block is at least
# this large. The dedup is a sort of the ids (XLA:CPU: ~7 ms for 32k ids) that saves
# repeated random row reads. Measured on 2 CPU cores it never paid: +5 % step time
# for the 'small' GEM (blocks of a few hundred KB), +10 % for dlrm_peer (one 205 MB
# block), and bench_embedding at 10^5..10^7 rows (up to 320 MB per device) was
# 3-10 % slower with it at every size. Kept for blocks beyond anything measured.
DEDUP_MIN_BYTES = 1 << 32
# Managed-collision map of a table (managed.py), int32 per row: the raw id's two halves,
# the step it was last seen, its lookup count; and the occupied slots (a scalar).
MAP_LEAVES = ("map_hi", "map_lo", "map_last", "map_count", "map_used")
MAP_BYTES_PER_ROW = 16
RW_EXCHANGES = ("auto", "a2a", "ragged", "broadcast")   # `plan_embeddings(rw_exchange=)`


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One leaf group of the state: a weight matrix (+ slots) holding one or more tables."""
  name: str
  kind: str                      # table_wise | row_wise | column_wise | replicated
  dim: int                       # true embedding width D
  local_dim: int                 # width held per device (cps for column_wise)
  dtype: object
  tables: tuple[str, ...]
  rows: int                      # global rows of the weight buffer (padded)
  local_rows: int                # rows held per device
  owners: tuple[int, ...] = ()   # table_wise: owner shard of each table
  offsets: tuple[int, ...] = ()  # table_wise: row offset of each table in its block

  num_shards: int = 1
  sync: str = "none"             # none | rows | dense (replica sync, see module doc)
  optimizer: SparseOptimizerConfig = SparseOptimizerConfig()   # of every table in it

  @property
  def sync_axes(self) -> tuple[str, ...]:
    """Mesh axes over which copies of this buffer's rows live."""
    return ("replica", "shard") if self.kind == "replicated" else ("replica",)

  @property
  def shape(self) -> tuple[int, int]:
    """Global (padded) shape of the weight buffer."""
    if self.kind == "column_wise":
      return (self.rows, self.local_dim * self.num_shards)
    return (self.rows, self.dim)

  def weight_spec(self) -> P:
    return {"table_wise": P("shard", None), "row_wise": P("shard", None),
            "column_wise": P(None, "shard"), "replicated": P(None, None)}[self.kind]

  def row_spec(self) -> P:
    """Spec of per-row slots (the row-wise Adagrad accumulator)."""
    return P("shard") if self.kind in ("table_wise", "row_wise") else P()


@dataclasses.dataclass(frozen=True)
class Unit:
  """One exchange: a set of features looked up together (the keys of rows/ctx)."""
  name: str
  kind: str
  buffer: str
  features: tuple[str, ...]
  pooled: bool
  bag: int                                  # ids per example (max over features)
  slots: tuple[tuple[int, ...], ...] = ()   # table_wise: slots[j][p] = index into features
  dedup: bool = False                       # owners gather each distinct row once
  distinct_share: float = 1.0               # row_wise: distinct ids / id slots per device
  owner_share: float = 0.0                  # row_wise: most of a device's distinct ids one
                                            # owner got in the id statistics (0: unknown)
  batch_distinct_share: float = 1.0         # row_wise: distinct ids / id slots of the
                                            # global batch (the largest sampled)


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
  """Placement of every table and the exchanges of every feature on `mesh`."""
  mesh: Mesh
  tables: dict[str, TableConfig]
  features: dict[str, FeatureConfig]
  optimizer: SparseOptimizerConfig
  batch_size: int
  sharding: dict[str, str]        # table -> chosen sharding type
  buffers: dict[str, Buffer]
  units: dict[str, Unit]
  buffer_of: dict[str, str]       # table -> buffer name
  rw_exchange: str = "a2a"        # row_wise: by owner 'a2a' (padded, C per pair) or 'ragged'
                                  # (ragged_all_to_all, M per owner); 'broadcast' (always)
  id_stats: dict | None = None    # feature -> stats.IdStats the plan was made with
  _jit_cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def cached_jit(self, key: str, build):
    """A jitted function built once per plan (init/export/import reuse their compilation)."""
    if key not in self._jit_cache:
      self._jit_cache[key] = build()
    return self._jit_cache[key]

  @property
  def num_replicas(self) -> int:
    return self.mesh.shape["replica"]

  @property
  def num_shards(self) -> int:
    return self.mesh.shape["shard"]

  @property
  def local_batch(self) -> int:
    return self.batch_size // (self.num_replicas * self.num_shards)

  def with_batch_size(self, batch_size: int) -> "EmbeddingPlan":
    """This plan for another global batch (e.g. eval): one placement, batch a separate input.

    Tables, features, optimizer, sharding types, buffers (placement, offsets,
    replica sync) and exchange units are this plan's, so the plan reads this
    plan's state by construction; only `batch_size` and what derives from it
    (`local_batch`, the per-step row shapes and byte counts) change.
    """
    batch_size = int(batch_size)
    if batch_size == self.batch_size:
      return self
    R, S = self.num_replicas, self.num_shards
    if batch_size <= 0 or batch_size % (R * S):
      raise ValueError(f"global batch {batch_size} is not divisible by the {R}x{S} mesh")
    return dataclasses.replace(self, batch_size=batch_size, _jit_cache={})

  # ---- shardings -----------------------------------------------------------------
  def _ns(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def state_specs(self) -> dict:
    specs = {}
    for name, buf in self.buffers.items():
      s = {"weight": buf.weight_spec()}
      for slot in buf.optimizer.slot_names():
        s[slot] = {"accumulator": buf.row_spec(), "m": buf.weight_spec(),
                   "v": buf.weight_spec(), "step": P()}[slot]
      if self.is_managed(name):
        s.update({leaf: (P() if leaf == "map_used" else buf.row_spec()) for leaf in MAP_LEAVES})
      specs[name] = s
    return specs

  def state_shardings(self) -> dict:
    """A pytree of NamedSharding matching the embedding state."""
    return {b: {k: self._ns(s) for k, s in d.items()} for b, d in self.state_specs().items()}

  def ids_shardings(self) -> dict[str, NamedSharding]:
    """Batch split over ('replica', 'shard'): one NamedSharding per feature."""
    return {f: self._ns(P(BATCH, None)) for f in self.features}

  def batch_sharding(self) -> NamedSharding:
    """`P(('replica', 'shard'))`: dim 0 (the global batch) split over every device, the
    rest replicated; for dense inputs, labels and weights of any rank."""
    return self._ns(P(BATCH))

  def canonical_shardings(self) -> dict:
    """Shardings of `export_state`'s unpadded arrays (row-split where rows divide evenly)."""
    out = {}
    for t, cfg in self.tables.items():
      s = {"weight": self._ns(layout.canonical_spec(cfg.rows, cfg.dim, self.num_shards))}
      for slot in self.table_optimizer(t).slot_names():
        if slot == "accumulator":
          s[slot] = self._ns(layout.canonical_spec(cfg.rows, None, self.num_shards))
        elif slot == "step":
          s[slot] = self._ns(P())
        else:
          s[slot] = s["weight"]
      if cfg.id_policy == "managed":
        row = self._ns(layout.canonical_spec(cfg.rows, None, self.num_shards))
        s.update({leaf: (self._ns(P()) if leaf == "map_used" else row) for leaf in MAP_LEAVES})
      out[t] = s
    return out

  def is_managed(self, buffer: str) -> bool:
    """Does `buffer` hold a managed-collision table (map leaves next to its slots)?"""
    buf = self.buffers[buffer]
    return buf.kind == "row_wise" and self.tables[buf.tables[0]].id_policy == "managed"

  def managed_tables(self) -> list[str]:
    return [t for t, c in self.tables.items() if c.id_policy == "managed"]

  def table_optimizer(self, table: str) -> SparseOptimizerConfig:
    """The optimizer of `table`: its own, else the plan's."""
    return self.tables[table].optimizer or self.optimizer

  def _capacities(self, slots: int, distinct: float, owner_share: float) -> tuple[int, int]:
    """(C, M) for `slots` id slots per device holding ~`distinct` distinct ids, the most
    one owner got `owner_share` of them (0: unknown). C, ids one device sends one owner:
    `layout.rw_capacity` of the distinct ids over S owners, or 1.1 x the skew if more, at
    most the slots. M, ids one owner receives from its whole group (ragged): S sources send
    ~distinct / S each, so the sum is binomial with mean `distinct`, `layout.rw_capacity` of
    S x distinct over S owners, or 1.1 x S x the skew, at most S x the slots (no overflow);
    M <= S C: the per-pair spreads average out over the S sources."""
    S = self.num_shards
    C = min(slots, max(layout.rw_capacity(distinct, S, slots),
                       math.ceil(1.1 * owner_share * distinct)))
    M = min(S * slots, max(layout.rw_capacity(S * distinct, S, S * slots),
                           math.ceil(1.1 * S * owner_share * distinct)))
    return C, M

  def _unit_capacities(self, u: Unit) -> tuple[int, int]:
    slots = self.local_batch * u.bag
    return self._capacities(slots, u.distinct_share * slots, u.owner_share)

  def capacity(self, u: Unit) -> int:
    """Row-wise unit `u`: ids one device sends one owner per step (padded all_to_all), from
    its expected distinct ids (`u.distinct_share` of its b x bag id slots) and the id
    statistics' skew (`_capacities`)."""
    return self._unit_capacities(u)[0]

  def recv_capacity(self, u: Unit) -> int:
    """Row-wise unit `u`, ragged exchange: ids one owner receives from its whole group per
    step (`_capacities`): flat in S."""
    return self._unit_capacities(u)[1]

  def managed_capacity(self, table: str) -> tuple[int, int]:
    """Managed table: (C, M) of its map route (managed.py), for the ids of all its features
    together, from their units' distinct shares and skew: C per (device, owner) padded, M
    per owner ragged. Without id statistics every id slot counts as distinct."""
    us = [u for u in self.units.values()
          if u.kind == "row_wise" and self.features[u.features[0]].table == table]
    slots = sum(self.local_batch * u.bag for u in us)
    distinct = sum(u.distinct_share * self.local_batch * u.bag for u in us)
    return self._capacities(slots, distinct, max(u.owner_share for u in us))

  def managed_owner_distinct(self, table: str) -> int:
    """Managed table: distinct ids one owner resolves per step after deduplicating what its
    requesters sent (those of the global batch in its windows): `layout.rw_capacity` of
    the batch's distinct ids (`Unit.batch_distinct_share` of its B x bag slots, all the
    table's features together) over the S owners. Without id statistics every slot.
      Example: B = 4,096, bag 4, S = 8, half the slots distinct: 8,192 ids, 1,024 per
      owner, 1,024 + 4 sqrt(1,024) + 1 = 1,153. With one shard (S = 1) the same margin over
      the batch's distinct ids (`layout.rw_capacity` would give every slot)."""
    us = [u for u in self.units.values()
          if u.kind == "row_wise" and self.features[u.features[0]].table == table]
    slots = sum(self.batch_size * u.bag for u in us)
    distinct = sum(u.batch_distinct_share * self.batch_size * u.bag for u in us)
    if self.num_shards == 1:   # one owner: no split to allow for, the margin of the count
      return layout.count_bound(distinct, slots)
    return layout.rw_capacity(distinct, self.num_shards, slots)

  def rw_slots(self, u: Unit) -> int:
    """Row-wise unit `u`: id slots of each owner's receive buffers per step (S C padded,
    M ragged, S x the slots broadcast): the (row, gradient) pairs it updates."""
    if self.rw_exchange == "a2a":
      return self.num_shards * self.capacity(u)
    if self.rw_exchange == "ragged":
      return self.recv_capacity(u)
    return self.num_shards * self.local_batch * u.bag

  def rw_wire_ids(self, u: Unit) -> float:
    """Row-wise unit `u`: ids (and rows, gradients) one device puts on the wire per step
    (its own block included): the padded S C, or the expected distinct ids when ragged."""
    if self.rw_exchange == "ragged":
      return u.distinct_share * self.local_batch * u.bag
    return self.rw_slots(u)

  # ---- sizes -----------------------------------------------------------------------
  def unit_rows_shape(self, u: Unit) -> tuple[int, ...]:
    """Per-device shape of the `rows` leaf of unit `u` (ids, then width)."""
    S, b, buf = self.num_shards, self.local_batch, self.buffers[u.buffer]
    if u.kind == "table_wise":
      return (S, len(u.slots[0]), b, u.bag, buf.dim)
    if u.kind == "replicated":
      return (b, u.bag, buf.dim)
    if u.kind == "row_wise":
      return (b * u.bag, buf.dim)              # the device's distinct rows, fetched
    return (S * b, u.bag, buf.local_dim)

  def device_bytes(self) -> dict[str, int]:
    """Bytes of weights + optimizer slots held by each device, per buffer."""
    out = {}
    for name, buf in self.buffers.items():
      itemsize = jnp.dtype(buf.dtype).itemsize
      w = buf.local_rows * buf.local_dim * itemsize
      slots = buf.local_rows * buf.optimizer.slot_bytes_per_row(buf.local_dim)
      if buf.kind == "column_wise" and buf.optimizer.kind == "rowwise_adagrad":
        slots = buf.rows * 4
      if self.is_managed(name):
        slots += buf.local_rows * MAP_BYTES_PER_ROW
      out[name] = w + slots
    return out

  def sync_group(self, buf: Buffer) -> int:
    """Devices holding copies of each row of `buf` (its replica-sync group size)."""
    return int(np.prod([self.mesh.shape[a] for a in buf.sync_axes]))

  def buffer_lookup_slots(self) -> dict[str, int]:
    """Row slots each device gathers per step, per buffer (the row gradients it holds)."""
    out = {name: 0 for name in self.buffers}
    for u in self.units.values():
      n = None
      if u.kind == "row_wise":          # (row, gradient) pairs routed to the owners
        n = self.rw_slots(u)
      out[u.buffer] += n if n is not None else int(np.prod(self.unit_rows_shape(u)[:-1]))
    return out

  def forward_bytes(self) -> dict[str, int]:
    """Bytes each device sends per step for the lookups, per unit: ids out, embeddings
    back, their gradients out again (padded buffers, the (S-1)/S part that leaves)."""
    S = self.num_shards
    out = {}
    for name, u in self.units.items():
      buf = self.buffers[u.buffer]
      isz = jnp.dtype(buf.dtype).itemsize
      shape = self.unit_rows_shape(u)
      if u.kind == "row_wise" and self.rw_exchange != "broadcast":
        n_rows = self.rw_wire_ids(u)   # ids out (lookup, update), rows back, grads out
        fwd = (S - 1) / S * (2 * 4 * n_rows + 2 * n_rows * shape[-1] * isz)
        if self.rw_exchange == "ragged":   # the routes: 3 S int32 per direction, twice
          fwd += (S - 1) / S * 2 * 3 * S * 4
      elif u.kind == "row_wise":       # all-gathers of ids (twice) and fp32 grads, psum_scatter
        n = shape[0]                   # of the (S n, D) rows
        fwd = (S - 1) * n * (2 * 4 + 4 * shape[-1]) + (S - 1) / S * S * n * shape[-1] * isz
      else:
        n_rows = int(np.prod(shape[:-1]))
        out_rows = n_rows if not u.pooled else n_rows // u.bag
        fwd = 0 if u.kind == "replicated" else (S - 1) / S * (
            4 * n_rows + 2 * out_rows * shape[-1] * isz)
      out[name] = int(fwd)
    return out

  def rw_buffer_bytes(self) -> dict[str, int]:
    """Row-wise units: bytes of the exchange buffers each device fills per step (ids out
    twice, rows back, gradients out), its own block included: `forward_bytes` is the part
    that leaves the device, (S - 1) / S of this for the all_to_all."""
    out = {}
    for name, u in self.units.items():
      if u.kind == "row_wise":
        S, isz = self.num_shards, jnp.dtype(self.buffers[u.buffer].dtype).itemsize
        n = self.rw_slots(u)
        out[name] = int(n * (2 * 4 + self.buffers[u.buffer].dim * (isz + 4)))
    return out

  def sync_bytes(self, sync: str | None = None) -> dict[str, int]:
    """Bytes each device sends per step for the replica sync, per buffer.

    rows:  (G - 1) x n x (D_local + 1) x 4      (all-gather of row ids + fp32 gradients)
    dense: 2 (G - 1) / G x N_pad x (D_local + 1) x 4  (reduce-scatter + all-gather of the
           shard's gradient and touch counts, N_pad = local rows rounded up to G)
    with G the sync group size, n the row slots per device, N the local rows.
    `sync` overrides the planned kind (to compare the alternatives).
    """
    slots = self.buffer_lookup_slots()
    out = {}
    for name, buf in self.buffers.items():
      g = self.sync_group(buf)
      kind = sync or buf.sync
      out[name] = 0 if g == 1 or kind == "none" else _sync_bytes(
          kind, g, slots[name], buf.local_rows, buf.local_dim)
    return out

  def exchange_bytes(self) -> dict[str, int]:
    """Bytes each device sends per training step: `forward_bytes` per unit plus
    `sync_bytes` per buffer (keys 'sync/<buffer>')."""
    out = dict(self.forward_bytes())
    out.update({f"sync/{k}": v for k, v in self.sync_bytes().items()})
    return out

  def lookups_per_device(self) -> np.ndarray:
    """Expected (uniform ids) valid lookups served per device per step, (S,) over shards."""
    S, B, R = self.num_shards, self.batch_size, self.num_replicas
    load = np.zeros(S)
    for f in self.features.values():
      t = self.tables[f.table]
      buf = self.buffers[self.buffer_of[f.table]]
      n = B * f.bag / R   # per replica group
      if buf.kind == "table_wise":
        load[buf.owners[buf.tables.index(t.name)]] += n
      elif buf.kind == "row_wise":
        load += n / S
      elif buf.kind == "column_wise":
        load += n
      else:
        load += n / S
    return load

  def table_placement(self, table: str) -> str:
    """Where `table` lives in its buffer, e.g. 'rows 100:150 (shard 1)' (global rows)."""
    buf = self.buffers[self.buffer_of[table]]
    if buf.kind == "table_wise":
      i = buf.tables.index(table)
      lo = buf.owners[i] * buf.local_rows + buf.offsets[i]
      return f"rows {lo}:{lo + self.tables[table].rows} (shard {buf.owners[i]})"
    if buf.kind == "row_wise":
      return f"rows 0:{self.tables[table].rows}, {buf.local_rows} per shard"
    if buf.kind == "column_wise":
      return f"cols 0:{buf.dim}, {buf.local_dim} per shard"
    return "whole, on every device"

  def describe_tables(self) -> list[str]:
    """One line per table: size, dtype, sharding, its state buffer (`state[buffer]`) and
    place in it, replica sync, optimizer, id policy, expected share of merged ids.

    merged = `config.expected_collision_rate(rows, vocab, id_policy)`: 1 - E[rows
    hit] / vocab, with E[rows hit] = rows (1 - (1 - 1/rows)^vocab) for 'hash';
    '?' when the table's `vocab` is unknown.
    """
    head = ("table", "rows x dim", "dtype", "sharding", "buffer", "place in buffer", "sync",
            "optimizer", "id_policy", "merged ids")
    rows = []
    for t, c in self.tables.items():
      rate = expected_collision_rate(c.rows, c.vocab, c.id_policy)
      merged = ("? (vocab unknown)" if rate is None else f"{100 * rate:.1f} %"
                + (f" of {c.vocab}" if c.vocab is not None and c.id_policy != "error" else ""))
      buf = self.buffers[self.buffer_of[t]]
      o = buf.optimizer
      rows.append((t, f"{c.rows}x{c.dim}", jnp.dtype(c.dtype).name, self.sharding[t], buf.name,
                   self.table_placement(t), buf.sync, f"{o.kind} lr {o.lr:g}", c.id_policy,
                   merged))
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  " + " | ".join(x.ljust(w) for x, w in zip(r, width)).rstrip()  # noqa: E731
    return ["tables (state and checkpoints key weights by buffer; export_state by table):",
            fmt(head), *map(fmt, rows)]

  def describe_exchanges(self) -> list[str]:
    """One line per row-wise unit (all_to_all capacity), and the id statistics per feature."""
    lines = []
    for name, u in self.units.items():
      if u.kind == "row_wise":
        slots = self.local_batch * u.bag
        cap = (f"receive capacity {self.recv_capacity(u)} ids per owner"
               if self.rw_exchange == "ragged" else
               f"capacity {self.capacity(u)} ids per (device, owner)")
        lines.append(f"  {name}: {self.rw_exchange}, {cap} of {slots} slots per device "
                     f"(distinct share {u.distinct_share:.2f})")
    for f, st in sorted((self.id_stats or {}).items()):
      lines.append(f"  ids {f}: {st.describe()}")
    return lines

  def describe(self) -> str:
    """Text: the per-table lines of `describe_tables` (table -> state buffer, expected
    merged ids), then device | bytes | lookups/step | exchange bytes/step | shards held."""
    S, R = self.num_shards, self.num_replicas
    held = [[] for _ in range(S)]
    for name, buf in self.buffers.items():
      for i, t in enumerate(buf.tables):
        rows = self.tables[t].rows
        if buf.kind == "table_wise":
          held[buf.owners[i]].append(f"{t}[tw]")
        elif buf.kind == "row_wise":
          for j in range(S):
            lo = min(j * buf.local_rows, rows)
            hi = min((j + 1) * buf.local_rows, rows)
            held[j].append(f"{t}[rw {lo}:{hi}]")
        elif buf.kind == "column_wise":
          for j in range(S):
            lo, hi = min(j * buf.local_dim, buf.dim), min((j + 1) * buf.local_dim, buf.dim)
            held[j].append(f"{t}[cw cols {lo}:{hi}]")
        else:
          for j in range(S):
            held[j].append(f"{t}[rep]")
    per_buf = self.device_bytes()
    dev_bytes = [0] * S
    for name, buf in self.buffers.items():
      for j in range(S):
        if buf.kind != "table_wise":
          dev_bytes[j] += per_buf[name]
      if buf.kind == "table_wise":
        # Only the filled part of each block is counted as used (the rest is padding).
        isz = jnp.dtype(buf.dtype).itemsize
        for i, t in enumerate(buf.tables):
          rows = self.tables[t].rows
          dev_bytes[buf.owners[i]] += rows * (buf.dim * isz
                                              + buf.optimizer.slot_bytes_per_row(buf.dim))
    lookups = self.lookups_per_device()
    exch = sum(self.exchange_bytes().values())
    lines = [f"embedding plan: mesh replica={R} x shard={S}, global batch {self.batch_size}, "
             f"optimizer {self.optimizer.kind}",
             *self.describe_tables(), *self.describe_exchanges(),
             f"{'device':>8} | {'bytes':>14} | {'lookups/step':>12} | {'exchange B/step':>15} | shards held"]
    for j in range(S):
      for r in range(R):
        dev = self.mesh.devices[r, j]
        lines.append(f"{f'{r},{j}({dev.id})':>8} | {dev_bytes[j]:>14,d} | {int(lookups[j]):>12d} | "
                     f"{exch:>15,d} | {' '.join(held[j])}")
    return "\n".join(lines)


# ---- planning --------------------------------------------------------------------------
def check_mesh(mesh: Mesh) -> None:
  """Raises ValueError unless `mesh` has exactly the axes ('replica', 'shard')."""
  names = tuple(getattr(mesh, "axis_names", ()))
  if names != BATCH:
    raise ValueError(
        f"the embedding engine needs a Mesh with axis_names ('replica', 'shard') (tables split "
        f"over 'shard', copied over 'replica'), got {names}: build it as Mesh(devices.reshape("
        f"R, S), ('replica', 'shard')) or gem_jax.parallel.mesh.make_mesh((R, S))")


def _opt_tag(opt: SparseOptimizerConfig) -> str:
  """A buffer-name suffix for a non-default optimizer, e.g. 'sgd_lr0.1'."""
  return f"{opt.kind}_lr{opt.lr:g}"


def _table_bytes(t: TableConfig, opt: SparseOptimizerConfig) -> int:
  return t.rows * (t.dim * jnp.dtype(t.dtype).itemsize + opt.slot_bytes_per_row(t.dim))


def _sync_bytes(kind: str, group: int, slots: int, local_rows: int, width: int) -> int:
  if kind == "rows":
    return int((group - 1) * slots * (width + 1) * 4)
  padded = -(-local_rows // group) * group
  return int(2 * (group - 1) / group * padded * (width + 1) * 4)


def _choose_sync(plan: EmbeddingPlan, replica_sync: str) -> EmbeddingPlan:
  """Sets `Buffer.sync` per buffer ('auto': the kind that sends fewer bytes)."""
  if replica_sync not in ("auto", "rows", "dense"):
    raise ValueError(f"replica_sync must be 'auto', 'rows' or 'dense', got {replica_sync!r}")
  slots = plan.buffer_lookup_slots()
  new = {}
  for name, buf in plan.buffers.items():
    g = plan.sync_group(buf)
    kind = replica_sync
    if g == 1:
      kind = "none"
    elif kind == "auto":
      by = {k: _sync_bytes(k, g, slots[name], buf.local_rows, buf.local_dim)
            for k in ("rows", "dense")}
      kind = "dense" if by["dense"] < by["rows"] else "rows"
    new[name] = dataclasses.replace(buf, sync=kind)
  return dataclasses.replace(plan, buffers=new)


def _fits_error(t: TableConfig, kind: str, need: int, budget: int, used: int) -> ValueError:
  return ValueError(
      f"embedding table {t.name!r} ({t.rows} rows x {t.dim} dims, {need:,d} "
      f"bytes per device as {kind}, weights + optimizer slots) does not fit the per-device "
      f"memory budget of {budget:,d} bytes ({used:,d} already used on the fullest device)")


def plan_embeddings(tables: Sequence[TableConfig], features: Sequence[FeatureConfig],
                    mesh: Mesh, batch_size: int,
                    optimizer: SparseOptimizerConfig | None = None,
                    memory_budget_bytes: int | None = None,
                    replicate_max_bytes: int = REPLICATE_MAX_BYTES,
                    replica_sync: str = "auto",
                    dedup_min_bytes: int = DEDUP_MIN_BYTES,
                    distinct_share: dict[str, float] | None = None,
                    rw_exchange: str = "auto", id_stats: dict | None = None) -> EmbeddingPlan:
  """Places `tables` on `mesh` ('replica', 'shard') for a global batch of `batch_size`.

  `mesh`: any `jax.sharding.Mesh` whose axis_names are ('replica', 'shard'), in that
  order (e.g. `Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('replica', 'shard'))`).
  `batch_size` is the global batch (all devices together); the plan accepts only
  that batch: `plan.with_batch_size(b)` is the same placement for another one
  (it reads the same state, see docs/embedding.md). `memory_budget_bytes`: weights + slots allowed per device;
  None (default) = no limit (then every 'auto' table above `replicate_max_bytes`
  becomes table-wise).

  'auto' tables become 'replicated' when tiny (<= replicate_max_bytes with slots),
  'table_wise' when they fit one device's remaining budget, else 'row_wise'.
  Table-wise tables are balanced over shards by cost = bytes share + lookups share.
  `replica_sync` ('auto' | 'rows' | 'dense') sets how replicas sync (module doc).
  Units whose owners hold at least `dedup_min_bytes` of weights per device
  deduplicate ids before gathering (0: always, a huge value: never).
  `distinct_share`: {feature: distinct ids / id slots per device and step} (measured,
  see `stats.id_stats`; default 1: every slot distinct) sets each row-wise unit's
  all_to_all capacity (`EmbeddingPlan.capacity`); `id_stats` ({feature: stats.IdStats}
  of a sample of batches) sets it where `distinct_share` does not, and weighs the
  table-wise placement by the valid lookups. `rw_exchange`: 'auto' (default) is
  'ragged' (`ragged_all_to_all`, only real ids travel) on GPU/TPU meshes and 'a2a'
  (padded all_to_all, C per pair) on CPU; 'ragged' on CPU runs the same contract on
  padded blocks (module `ragged`, to test it); 'broadcast' sends every row-wise lookup
  the exact fallback's way (all-gathered ids; to compare).

  Raises:
    ValueError naming the table, its size and the budget when it does not fit;
    ValueError for unknown tables, duplicate names or an indivisible batch.
    ValueError when `mesh` does not have the axes ('replica', 'shard') (`check_mesh`).
  """
  opt = optimizer or SparseOptimizerConfig()
  opt_of = lambda t: t.optimizer or opt   # noqa: E731  (a table's own optimizer or the plan's)
  check_mesh(mesh)
  R, S = mesh.shape["replica"], mesh.shape["shard"]
  tables = {t.name: t for t in tables}
  features = {f.name: f for f in features}
  if batch_size % (R * S):
    raise ValueError(f"global batch {batch_size} is not divisible by the {R}x{S} mesh")
  for f in features.values():
    if f.table not in tables:
      raise ValueError(f"feature {f.name!r} reads unknown table {f.table!r}; "
                       f"known: {sorted(tables)}")
  budget = memory_budget_bytes if memory_budget_bytes is not None else 1 << 62
  lookups = {t: 0 for t in tables}
  for f in features.values():
    valid = id_stats[f.name].valid_share if id_stats and f.name in id_stats else 1.0
    lookups[f.table] += batch_size * f.bag * valid
  distinct_share = {**{f: st.distinct_share for f, st in (id_stats or {}).items()},
                    **(distinct_share or {})}

  # 1. Sharding types and per-device bytes of everything spread over all shards.
  sharding, spread = {}, 0
  for t in tables.values():
    kind = t.sharding
    if t.id_policy == "managed":    # the map is sharded with the rows (managed.py)
      kind = "row_wise"
    elif kind == "auto":
      if S == 1 or _table_bytes(t, opt_of(t)) <= replicate_max_bytes:
        kind = "replicated" if S > 1 else "table_wise"
      elif _table_bytes(t, opt_of(t)) <= budget / 2:
        kind = "table_wise"
      else:
        kind = "row_wise"
    sharding[t.name] = kind
  for t in tables.values():
    kind = sharding[t.name]
    isz = jnp.dtype(t.dtype).itemsize
    if kind == "row_wise":
      need = layout.rows_per_shard(t.rows, S) * (t.dim * isz
                                                 + opt_of(t).slot_bytes_per_row(t.dim)
                                                 + (MAP_BYTES_PER_ROW if t.id_policy == "managed"
                                                    else 0))
    elif kind == "column_wise":
      cps = layout.cols_per_shard(t.dim, S)
      need = t.rows * (cps * isz + (4 if opt_of(t).kind == "rowwise_adagrad" else
                                    opt_of(t).slot_bytes_per_row(cps)))
    elif kind == "replicated":
      need = _table_bytes(t, opt_of(t))
    else:
      continue
    if spread + need > budget:
      raise _fits_error(t, kind, need, budget, spread)
    spread += need

  # 2. Table-wise placement, balanced on bytes and lookups.
  tw = [t for t in tables.values() if sharding[t.name] == "table_wise"]
  tot_b = sum(_table_bytes(t, opt_of(t)) for t in tw) or 1
  tot_l = sum(lookups[t.name] for t in tw) or 1
  costs = [_table_bytes(t, opt_of(t)) / tot_b + lookups[t.name] / tot_l for t in tw]
  owners = dict(zip((t.name for t in tw), layout.assign_table_wise(costs, S)))
  used = [spread] * S
  for t in sorted(tw, key=lambda t: -_table_bytes(t, opt_of(t))):
    used[owners[t.name]] += _table_bytes(t, opt_of(t))
    if used[owners[t.name]] > budget:
      raise _fits_error(t, "table_wise", _table_bytes(t, opt_of(t)), budget,
                        used[owners[t.name]] - _table_bytes(t, opt_of(t)))

  # 3. Buffers (table-wise tables packed by (dim, dtype, optimizer)).
  buffers, buffer_of = {}, {}
  groups: dict[tuple, list[TableConfig]] = {}
  for t in tw:
    groups.setdefault((t.dim, jnp.dtype(t.dtype).name, opt_of(t)), []).append(t)
  for (dim, dtname, t_opt), ts in groups.items():
    name = f"tw_d{dim}_{dtname}" + ("" if t_opt == opt else f"_{_opt_tag(t_opt)}")
    own = [owners[t.name] for t in ts]
    offsets, cap = layout.block_offsets(own, [t.rows for t in ts], S)
    buffers[name] = Buffer(name, "table_wise", dim, dim, ts[0].dtype, tuple(t.name for t in ts),
                           rows=S * cap, local_rows=cap, owners=tuple(own),
                           offsets=tuple(offsets), num_shards=S, optimizer=t_opt)
    for t in ts:
      buffer_of[t.name] = name
  for t in tables.values():
    kind = sharding[t.name]
    if kind == "row_wise":
      rps = layout.rows_per_shard(t.rows, S)
      if t.id_policy == "managed":  # whole probe windows per shard
        rps = t.probe * layout.rows_per_shard(t.rows // t.probe, S)
      buffers[t.name] = Buffer(t.name, kind, t.dim, t.dim, t.dtype, (t.name,), S * rps, rps,
                               num_shards=S, optimizer=opt_of(t))
    elif kind == "column_wise":
      buffers[t.name] = Buffer(t.name, kind, t.dim, layout.cols_per_shard(t.dim, S), t.dtype,
                               (t.name,), t.rows, t.rows, num_shards=S, optimizer=opt_of(t))
    elif kind == "replicated":
      buffers[t.name] = Buffer(t.name, kind, t.dim, t.dim, t.dtype, (t.name,), t.rows, t.rows,
                               num_shards=S, optimizer=opt_of(t))
    else:
      continue
    buffer_of[t.name] = t.name

  for buf in buffers.values():   # padded and packed buffers too: int32 global row ids
    if buf.rows > MAX_ROWS:
      raise ValueError(
          f"buffer {buf.name!r} ({buf.kind}, tables {list(buf.tables)}) needs {buf.rows:,d} "
          f"global rows on {S} shards, more than the engine can address ({MAX_ROWS:,d}: "
          "device row ids are int32); use fewer or smaller tables")

  # 4. Exchange units.
  units = {}
  tw_groups: dict[tuple[str, bool], list[FeatureConfig]] = {}
  for f in features.values():
    buf = buffers[buffer_of[f.table]]
    pooled = f.pooling != "none"
    if buf.kind == "table_wise":
      tw_groups.setdefault((buf.name, pooled), []).append(f)
    else:
      name = f"{buf.kind}.{f.name}"
      share = min(1.0, (distinct_share or {}).get(f.name, 1.0))
      st = (id_stats or {}).get(f.name)
      owner = st.max_owner_share if st else 0.0
      batch_share = min(1.0, st.batch_distinct_share) if st else 1.0
      units[name] = Unit(name, buf.kind, buf.name, (f.name,), pooled, f.bag,
                         distinct_share=share if buf.kind == "row_wise" else 1.0,
                         owner_share=owner if buf.kind == "row_wise" else 0.0,
                         batch_distinct_share=batch_share if buf.kind == "row_wise" else 1.0)
  for (bname, pooled), fs in tw_groups.items():
    buf = buffers[bname]
    own = [buf.owners[buf.tables.index(f.table)] for f in fs]
    slots, _ = layout.slot_table(own, S)
    name = f"{bname}.{'pooled' if pooled else 'seq'}"
    units[name] = Unit(name, "table_wise", bname, tuple(f.name for f in fs), pooled,
                       max(f.bag for f in fs), tuple(tuple(s) for s in slots))
  units = {n: dataclasses.replace(u, dedup=_local_weight_bytes(buffers[u.buffer]) >= dedup_min_bytes)
           for n, u in units.items()}
  if rw_exchange not in RW_EXCHANGES:
    raise ValueError(f"rw_exchange {rw_exchange!r} not in {RW_EXCHANGES}")
  if rw_exchange == "auto":   # ragged where the backend has it, padded on XLA:CPU
    rw_exchange = "ragged" if ragged.is_native(mesh) else "a2a"
  plan = EmbeddingPlan(mesh, tables, features, opt, batch_size, sharding, buffers, units,
                       buffer_of, rw_exchange, dict(id_stats) if id_stats else None)
  return _choose_sync(plan, replica_sync)


def _local_weight_bytes(buf: Buffer) -> int:
  return buf.local_rows * buf.local_dim * jnp.dtype(buf.dtype).itemsize
