"""Reader of the columnar format: each process reads only its own rows, in parallel.

`ParquetSource(path)` opens a dataset written by scripts/preprocess.py
(gem_jax/data/columnar.py) and checks every file against the metadata before the
first batch. `batches()` cuts global batches of B rows out of L *lanes*:

  epoch e: row groups in the order rng((seed, e)).permutation(G)   (file order unshuffled)
           -> one sequence of N rows, cut into L contiguous lanes of N // L or N // L + 1 rows
  lane l:  windows of W rows, each permuted by rng((seed, e, l, w))
           (W = max(shuffle_buffer / L, MIN_SHUFFLE_WINDOW))
  batch t: rows [t k, (t + 1) k) of every lane, k = B // L, lanes in order

  process p of P owns lanes [p L / P, (p + 1) L / P): its rows [p b, (p + 1) b) of
  every global batch, b = B / P, and it reads only those lanes' row groups.

Worked example, N = 1000 rows in 10 row groups of 100, L = 4 lanes, B = 8 (k = 2), P = 2:
lane 0 is rows [0, 250) of the epoch's row-group order (groups 0, 1 and half of 2 of
that order), lane 1 rows [250, 500), ...; process 0 owns lanes 0-1, reads the first
five row groups of the order and yields rows (l0: 2 rows, l1: 2 rows) of each
batch; process 1 reads the other five. A run with P = 1 yields the same global
batches: its batch t is process 0's rows followed by process 1's.

The global batches depend on (seed, L, B, shuffle_buffer), never on P (any P that
divides L), so a checkpoint restores onto another process count. The iterator state
is the number of rows taken from each lane (all lanes take k per batch): resume is
exact and costs one window read per lane. With `repeat=False` (eval) a lane that
runs out pads its slots (`label_mask = 0`) until every lane is done: every row is
seen once. `workers` threads read and decode row groups ahead of the lanes
(pyarrow releases the GIL), in an order fixed by the plan, so the output does not
depend on them.

Every file's size and modification time are recorded when the source is built and
checked before and after each row group is read: a file that disappears, is cut
short or is replaced mid-run raises `files.InputFileError` naming it and what
changed (a row group read with the old footer would be garbage); once it is back as
it was, a restart resumes exactly (the iterator state holds rows per lane).
"""
from __future__ import annotations

import concurrent.futures
import math
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_jax.data import columnar
from gem_jax.data.columnar import DatasetError
from gem_jax.data.files import InputFileError, check_unchanged, fingerprint

DEFAULT_LANES = 16
# Lanes shuffle windows of at least this many rows: each window costs a gather per column,
# so 256-row windows (shuffle_buffer 4096 over 16 lanes) spent 30 % of a shuffled epoch on
# per-call overhead. More rows mix more; memory: lanes per process x this x row bytes.
MIN_SHUFFLE_WINDOW = 4096


def _padding(layout: list[columnar.Leaf], n: int) -> dict[str, np.ndarray]:
  """n padding rows: ids -1 (jagged: their pad), everything else 0 (label_mask 0)."""
  out = {}
  for leaf in layout:
    pad = leaf.pad if leaf.length is not None else (-1 if leaf.path.startswith("ids/") else 0)
    out[leaf.path] = np.full((n, *leaf.shape), pad, leaf.dtype)
  return out


def _columns(schema: pa.Schema) -> dict[str, str]:
  """{column: type} with list element names left out (Parquet renames them)."""
  def key(t):
    if pa.types.is_fixed_size_list(t):
      return f"{key(t.value_type)}[{t.list_size}]"
    if pa.types.is_list(t):
      return f"list<{key(t.value_type)}>"
    return str(t)
  return {f.name: key(f.type) for f in schema}


class ParquetSource:
  """A converted dataset (directory with dataset.json) as a source (gem_jax/data/source.py).

  Args:
    path: the dataset directory.
    shuffle_buffer: rows shuffled together over all lanes (<= 1: file order).
    lanes: L, the number of row streams a global batch is cut from; the batch size
      must be a multiple of L and the process count must divide it.
    workers: threads reading row groups ahead (0: read in the calling thread).
    data_cfg: the run's `config.data`, checked against the conversion (kind, options).
  """

  def __init__(self, path: str, *, shuffle_buffer: int = 0, lanes: int = DEFAULT_LANES,
               workers: int = 2, data_cfg: Any = None):
    self.path = path
    self.meta = columnar.read_meta(path)
    columnar.check_config(self.meta, data_cfg, path)
    self.spec = columnar.spec_from_json(self.meta["spec"])
    self.shared_vocab = self.meta.get("shared_vocab")
    self.layout = [columnar.Leaf.from_json(d) for d in self.meta["leaves"]]
    self.shuffle_buffer, self.lanes, self.workers = int(shuffle_buffer), int(lanes), int(workers)
    if self.lanes < 1:
      raise ValueError(f"{path}: data.lanes must be >= 1, got {lanes}")
    self._file_meta = self._check_files()
    # (file index, row group index, rows) in file order
    self.blocks = [(i, g, n) for i, f in enumerate(self.meta["files"])
                   for g, n in enumerate(f["row_groups"])]
    if sum(n for *_, n in self.blocks) != self.meta["rows"]:
      raise DatasetError(f"{path}/{columnar.META_NAME}: rows {self.meta['rows']} != the sum "
                         "of its files' row groups")

  @classmethod
  def from_config(cls, cfg, split: str) -> "ParquetSource":
    train = split == "train"
    return cls(cfg.train if train else cfg.eval,
               shuffle_buffer=cfg.get("shuffle_buffer", 0) if train else 0,
               lanes=cfg.get("lanes", DEFAULT_LANES), workers=cfg.get("reader_workers", 2),
               data_cfg=cfg)

  def _check_files(self) -> list:
    """Every file exists, has the size, row groups and schema the metadata says."""
    want = columnar.schema(self.layout)
    out = []
    self._fingerprints = []
    for f in self.meta["files"]:
      file = os.path.join(self.path, f["path"])
      if not os.path.isfile(file):
        raise DatasetError(f"{file}: listed in {columnar.META_NAME} but missing")
      self._fingerprints.append(fingerprint(file))
      size = os.path.getsize(file)
      if size != f["bytes"]:
        raise DatasetError(f"{file}: {size} bytes, {columnar.META_NAME} says {f['bytes']} "
                           "(truncated or replaced?)")
      try:
        md = pq.read_metadata(file)
      except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{file}: not a readable Parquet file ({e})") from None
      groups = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
      if groups != list(f["row_groups"]):
        raise DatasetError(f"{file}: row groups of {groups} rows, {columnar.META_NAME} "
                           f"says {f['row_groups']}")
      got = _columns(md.schema.to_arrow_schema())
      if got != _columns(want):
        w = _columns(want)
        diff = ([f"{k}: {v} expected" for k, v in w.items() if got.get(k) != v]
                + [f"{k}: {v} not expected" for k, v in got.items() if w.get(k) != v])
        raise DatasetError(f"{file}: schema differs from {columnar.META_NAME}: {diff[:4]}")
      out.append(md)
    extra = sorted(set(n for n in os.listdir(self.path) if n.endswith(".parquet"))
                   - {f["path"] for f in self.meta["files"]})
    if extra:
      raise DatasetError(f"{self.path}: {extra[0]} is not listed in {columnar.META_NAME} "
                         f"({len(extra)} such files)")
    return out

  def describe(self) -> str:
    return f"ParquetSource({self.path})"

  def num_rows(self) -> int:
    return int(self.meta["rows"])

  def read_block(self, b: int) -> tuple[dict[str, np.ndarray], int]:
    """Block b's leaves and the (compressed) bytes read for it."""
    i, g, _ = self.blocks[b]
    md = self._file_meta[i]
    file = os.path.join(self.path, self.meta["files"][i]["path"])
    check_unchanged(file, self._fingerprints[i])
    try:
      table = pq.ParquetFile(file, metadata=md).read_row_group(g)
    except (pa.ArrowException, OSError) as e:
      check_unchanged(file, self._fingerprints[i])
      raise InputFileError(f"input file {file}: row group {g} unreadable ({e})") from e
    check_unchanged(file, self._fingerprints[i])   # replaced while it was read
    rg = md.row_group(g)
    nbytes = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
    return columnar.from_table(table, self.layout), nbytes

  def batches(self, batch_size: int, *, process_index: int = 0, process_count: int = 1,
              seed: int = 0, repeat: bool = True, state: dict | None = None) -> "LaneIterator":
    return LaneIterator(self, batch_size, process_index=process_index,
                        process_count=process_count, seed=seed, repeat=repeat, state=state)


class _Blocks:
  """Decoded row groups: read ahead on `workers` threads, kept while a lane needs them."""

  def __init__(self, source: ParquetSource, workers: int):
    self.source = source
    self.pool = concurrent.futures.ThreadPoolExecutor(workers) if workers > 0 else None
    self.futures: dict[int, concurrent.futures.Future] = {}
    self.bytes_read = 0
    self.blocks_read = 0

  def prefetch(self, blocks) -> None:
    if self.pool is None:
      return
    for b in blocks:
      if b not in self.futures:
        self.futures[b] = self.pool.submit(self.source.read_block, b)

  def get(self, b: int) -> dict[str, np.ndarray]:
    fut = self.futures.pop(b, None)
    leaves, nbytes = fut.result() if fut is not None else self.source.read_block(b)
    self.bytes_read += nbytes
    self.blocks_read += 1
    return leaves

  def close(self) -> None:
    if self.pool is not None:
      for f in self.futures.values():
        f.cancel()
      self.pool.shutdown(wait=True)
      self.pool = None
    self.futures.clear()


class LaneIterator:
  """This process's host batches of a ParquetSource (see the module docstring)."""

  def __init__(self, source: ParquetSource, batch_size: int, *, process_index: int = 0,
               process_count: int = 1, seed: int = 0, repeat: bool = True,
               state: dict | None = None):
    L, B, P = source.lanes, int(batch_size), int(process_count)
    where = source.describe()
    if B <= 0 or B % L:
      raise ValueError(f"{where}: batch size {B} must be a positive multiple of "
                       f"data.lanes={L}")
    if L % P:
      raise ValueError(f"{where}: data.lanes={L} must be a multiple of the process count "
                       f"{P} (set data.lanes to a multiple of every process count the run "
                       "may use; it fixes the batches' composition)")
    if not 0 <= process_index < P:
      raise ValueError(f"process_index {process_index} not in [0, {P})")
    n = source.num_rows()
    if n < L:
      raise ValueError(f"{where}: {n} rows, fewer than data.lanes={L}")
    self.source, self.repeat, self.seed = source, bool(repeat), int(seed)
    self.global_batch_size, self.rows_per_lane_batch = B, B // L
    self.local_batch_size = B // P
    self.shuffle = source.shuffle_buffer > 1
    self.window = (max(MIN_SHUFFLE_WINDOW, math.ceil(source.shuffle_buffer / L)) if self.shuffle
                   else max(1, int(source.meta.get("row_group_rows", 4096))))
    per = L // P
    self.my_lanes = list(range(process_index * per, (process_index + 1) * per))
    self.lane_len = [((l + 1) * n) // L - (l * n) // L for l in range(L)]
    self.lane_start = [(l * n) // L for l in range(L)]
    self.taken, self.done = 0, False
    if state is not None:
      for k, mine in (("seed", self.seed), ("lanes", L), ("shuffle_buffer", source.shuffle_buffer),
                      ("rows", n)):
        if state.get(k) != mine:
          raise ValueError(f"cannot resume {where}: iterator state has {k}={state.get(k)} "
                           f"but this iterator has {k}={mine} (the row order would differ)")
      self.taken, self.done = int(state["lane_rows"]), bool(state["done"])
    self._blocks = _Blocks(source, source.workers)
    self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._windows: dict[int, tuple[tuple[int, int], dict]] = {}   # lane -> current window
    self._held: dict[int, dict[int, dict]] = {}                     # lane -> its row groups
    self._lane_cache: dict[tuple[int, int], list[int]] = {}
    self._started = False

  def state(self) -> dict:
    """JSON position after the last batch returned (independent of the process count)."""
    return {"lane_rows": self.taken, "done": self.done, "seed": self.seed,
            "lanes": self.source.lanes, "shuffle_buffer": self.source.shuffle_buffer,
            "rows": self.source.num_rows()}

  @property
  def bytes_read(self) -> int:
    """Compressed Parquet bytes this iterator has read."""
    return self._blocks.bytes_read

  # -- plan ---------------------------------------------------------------------------
  def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(row-group order, cumulative rows in that order) of `epoch`."""
    if epoch not in self._orders:
      g = len(self.source.blocks)
      order = (np.random.default_rng((self.seed, epoch)).permutation(g) if self.shuffle
               else np.arange(g))
      rows = np.asarray([self.source.blocks[b][2] for b in order], np.int64)
      self._orders = {e: v for e, v in self._orders.items() if e >= epoch - 1}
      self._orders[epoch] = (order, np.concatenate([[0], np.cumsum(rows)]))
    return self._orders[epoch]

  def _window_blocks(self, lane: int, epoch: int, w: int) -> list[tuple[int, int, int]]:
    """[(block, first row, end row)] of window w of `lane` in `epoch`."""
    order, cum = self._order(epoch)
    a = self.lane_start[lane] + w * self.window
    b = self.lane_start[lane] + min((w + 1) * self.window, self.lane_len[lane])
    i0 = int(np.searchsorted(cum, a, side="right")) - 1
    out = []
    for i in range(i0, len(order)):
      if cum[i] >= b:
        break
      out.append((int(order[i]), int(max(a, cum[i]) - cum[i]), int(min(b, cum[i + 1]) - cum[i])))
    return out

  def _load(self, lane: int, epoch: int, w: int) -> dict[str, np.ndarray]:
    """Window w of `lane` in `epoch`, permuted; prefetches the next one's row groups."""
    cached = self._windows.get(lane)
    if cached is not None and cached[0] == (epoch, w):
      return cached[1]
    parts = self._window_blocks(lane, epoch, w)
    held = self._held.get(lane, {})
    for blk, _, _ in parts:
      if blk not in held:
        held[blk] = self._blocks.get(blk)
    pieces = [{k: v[lo:hi] for k, v in held[blk].items()} for blk, lo, hi in parts]
    last = parts[-1][0]
    self._held[lane] = {last: held[last]}   # the next window may start in it
    win = (pieces[0] if len(pieces) == 1
           else {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]})
    if self.shuffle:
      n = len(win["domain"])
      perm = np.random.default_rng((self.seed, epoch, lane, w)).permutation(n)
      win = {k: v[perm] for k, v in win.items()}
    self._windows[lane] = ((epoch, w), win)
    self._blocks.prefetch(b for b in self._upcoming(lane, epoch, last)
                          if b not in self._held[lane])
    return win

  def _lane_blocks(self, lane: int, epoch: int) -> list[int]:
    """The row groups of `lane` in `epoch`, in the order the lane reads them."""
    key = (lane, epoch)
    if key not in self._lane_cache:
      n = self.lane_len[lane]
      order, cum = self._order(epoch)
      a, b = self.lane_start[lane], self.lane_start[lane] + n
      i0 = int(np.searchsorted(cum, a, side="right")) - 1
      i1 = int(np.searchsorted(cum, b, side="left"))
      self._lane_cache = {k: v for k, v in self._lane_cache.items() if k[1] >= epoch}
      self._lane_cache[key] = [int(x) for x in order[i0:i1]]
    return self._lane_cache[key]

  def _upcoming(self, lane: int, epoch: int, block: int) -> list[int]:
    """The `workers` (at least 1) row groups `lane` reads after `block`: read ahead by
    whole row groups, not windows, so a group is ready when the lane reaches it."""
    ahead = max(1, self.source.workers)
    blocks = self._lane_blocks(lane, epoch)
    nxt = blocks[blocks.index(block) + 1:][:ahead]
    if len(nxt) < ahead and self.repeat:
      nxt += self._lane_blocks(lane, epoch + 1)[:ahead - len(nxt)]
    return nxt

  def _take(self, lane: int, start: int, k: int) -> list[dict[str, np.ndarray]]:
    """Rows [start, start + k) of the lane's stream (epochs back to back when repeating)."""
    n, out = self.lane_len[lane], []
    while k > 0:
      epoch, r = divmod(start, n)
      if epoch > 0 and not self.repeat:
        out.append(_padding(self.source.layout, k))
        break
      w, pos = divmod(r, self.window)
      win = self._load(lane, epoch, w)
      cnt = min(k, len(win["domain"]) - pos)
      out.append({key: v[pos:pos + cnt] for key, v in win.items()})
      start, k = start + cnt, k - cnt
    return out

  # -- iteration ------------------------------------------------------------------------
  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self.done or (not self.repeat and self.taken >= max(self.lane_len)):
      self.done = True
      raise StopIteration
    if not self._started:
      self._started = True
      for lane in self.my_lanes:   # first windows of every lane: read them in parallel
        epoch, r = divmod(self.taken, self.lane_len[lane])
        if self.repeat or epoch == 0:
          self._blocks.prefetch(b for b, _, _ in
                                self._window_blocks(lane, epoch, r // self.window))
    k = self.rows_per_lane_batch
    pieces = [p for lane in self.my_lanes for p in self._take(lane, self.taken, k)]
    self.taken += k
    leaves = {key: np.concatenate([p[key] for p in pieces]) for key in pieces[0]}
    return columnar.unflatten(leaves)

  def close(self) -> None:
    self._blocks.close()
