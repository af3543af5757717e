"""Knowledge files: what a teacher said about every example, stored beside the raw data.

Layout of a knowledge directory (one writer per process, no shared files but
the index):

  DIR/index.json                 written by process 0 once every process is done
  DIR/p00000/shard-00000.npz     process 0's rows, in the order its data iterator
  DIR/p00000/shard-00001.npz     yielded them (`rows_per_shard` rows per file)
  DIR/p00001/...                 process 1, ...

Every shard holds the fields the generator was asked for, one row per example:

  'logits'        float32 (n, T)   teacher logits per task
  'trunk', ...    float32 (n, D_k) chosen intermediate embeddings (aux outputs)
  'valid'         bool    (n,)     False for the padding rows of the last batch
  'fingerprint'   uint64  (n,)     `fingerprint(batch)`: a hash of the raw row,
                                   checked when the rows are read back

`index.json` = {'version', 'fields': {name: [shape...]}, 'batch_size' (global),
'process_count', 'num_batches', 'rows_per_shard', 'shards': [[rows per shard]
per process], 'source', 'seed', 'teacher'}.

`KnowledgeSource(source, dir)` zips a data source with its knowledge: its
batches are the source's batches (same seed, one pass per epoch, same global
batch size and process count as at generation) plus `batch['teacher'] =
{field: (b, ...)}`; the fingerprints must match row by row, so a changed
source, seed or batch size fails loudly instead of pairing rows with another
example's knowledge. Only one shard per process is in memory at a time.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

INDEX = "index.json"
VERSION = 1
_M = np.uint64(0x9E3779B97F4A7C15)


def _mix(h: np.ndarray, x: np.ndarray) -> np.ndarray:
  """One splitmix-style round per column: h <- mix(h * M + x_col)  (uint64, wraps)."""
  for col in x.T:
    h = h * _M + col
    h ^= h >> np.uint64(31)
  return h


def fingerprint(batch: Mapping[str, Any]) -> np.ndarray:
  """uint64 (B,) hash of each row's dense values, ids, domain and labels (order-sensitive)."""
  dense = np.ascontiguousarray(batch["dense"], np.float32)
  b = dense.shape[0]
  h = np.full((b,), 0x243F6A8885A308D3, np.uint64)
  with np.errstate(over="ignore"):
    h = _mix(h, dense.view(np.uint32).astype(np.uint64).reshape(b, -1))
    for name in sorted(batch["ids"]):
      h = _mix(h, np.asarray(batch["ids"][name]).astype(np.int64).view(np.uint64).reshape(b, -1))
    h = _mix(h, np.asarray(batch["domain"]).astype(np.int64).view(np.uint64).reshape(b, 1))
    h = _mix(h, np.ascontiguousarray(batch["labels"], np.float32).view(np.uint32)
             .astype(np.uint64).reshape(b, -1))
  return h


def valid_rows(batch: Mapping[str, Any]) -> np.ndarray:
  """bool (B,): rows with at least one observed label (padding rows have none)."""
  return np.asarray(batch["label_mask"]).sum(axis=1) > 0


def process_dir(directory: str, process_index: int) -> str:
  return os.path.join(directory, f"p{process_index:05d}")


class KnowledgeWriter:
  """Appends one process's rows to `DIR/pPPPPP/shard-KKKKK.npz` files.

  Args:
    directory: the knowledge directory.
    process_index: this process.
    rows_per_shard: rows per file (the last one may be shorter).
  """

  def __init__(self, directory: str, process_index: int = 0, rows_per_shard: int = 65536):
    self.directory, self.process_index = directory, int(process_index)
    self.rows_per_shard = int(rows_per_shard)
    self.dir = process_dir(directory, self.process_index)
    os.makedirs(self.dir, exist_ok=True)
    for f in os.listdir(self.dir):  # a rerun replaces this process's shards
      if f.startswith("shard-"):
        os.remove(os.path.join(self.dir, f))
    self._pending: dict[str, list[np.ndarray]] = {}
    self._pending_rows = 0
    self.shard_rows: list[int] = []
    self.fields: dict[str, list[int]] | None = None

  def add(self, rows: Mapping[str, np.ndarray]) -> None:
    """Appends a batch of rows: {field: (b, ...)} with the same b for every field."""
    rows = {k: np.asarray(v) for k, v in rows.items()}
    n = {len(v) for v in rows.values()}
    if len(n) != 1:
      raise ValueError(f"fields have different row counts: { {k: len(v) for k, v in rows.items()} }")
    shapes = {k: list(v.shape[1:]) for k, v in rows.items()}
    if self.fields is None:
      self.fields = shapes
    elif shapes != self.fields:
      raise ValueError(f"field shapes changed from {self.fields} to {shapes}")
    for k, v in rows.items():
      self._pending.setdefault(k, []).append(v)
    self._pending_rows += n.pop()
    while self._pending_rows >= self.rows_per_shard:
      self._flush(self.rows_per_shard)

  def _flush(self, n: int) -> None:
    cat = {k: np.concatenate(v) for k, v in self._pending.items()}
    path = os.path.join(self.dir, f"shard-{len(self.shard_rows):05d}.npz")
    tmp = path + ".tmp.npz"
    np.savez(tmp, **{k: v[:n] for k, v in cat.items()})
    os.replace(tmp, path)
    self.shard_rows.append(n)
    self._pending = {k: [v[n:]] for k, v in cat.items()}
    self._pending_rows -= n

  def close(self) -> list[int]:
    """Writes the last partial shard; returns the rows of every shard."""
    if self._pending_rows:
      self._flush(self._pending_rows)
    return list(self.shard_rows)


def write_index(directory: str, *, fields: Mapping[str, list[int]], batch_size: int,
                process_count: int, num_batches: int, rows_per_shard: int,
                shards: list[list[int]], source: str, seed: int, teacher: Mapping) -> dict:
  """Writes `index.json` (process 0, after every process closed its writer)."""
  index = {"version": VERSION, "fields": dict(fields), "batch_size": int(batch_size),
           "process_count": int(process_count), "num_batches": int(num_batches),
           "rows_per_shard": int(rows_per_shard), "shards": shards, "source": source,
           "seed": int(seed), "teacher": dict(teacher)}
  tmp = os.path.join(directory, INDEX + ".tmp")
  with open(tmp, "w") as f:
    json.dump(index, f, indent=1)
  os.replace(tmp, os.path.join(directory, INDEX))
  return index


def read_index(directory: str) -> dict:
  path = os.path.join(directory, INDEX)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no knowledge index {path}: run scripts/generate_knowledge.py first "
                            "(or it did not finish)")
  with open(path) as f:
    index = json.load(f)
  if index.get("version") != VERSION:
    raise ValueError(f"{path}: knowledge format version {index.get('version')}, expected {VERSION}")
  return index


class ShardReader:
  """Reads one process's rows in order from its shards, one shard in memory at a time.

  `seek(row)` positions it at a row of this process's stream (exact resume).
  """

  def __init__(self, directory: str, process_index: int, shard_rows: list[int]):
    self.dir = process_dir(directory, process_index)
    self.starts = np.concatenate([[0], np.cumsum(shard_rows)]).astype(np.int64)
    self.total = int(self.starts[-1])
    self._shard, self._data, self.row = -1, None, 0

  def seek(self, row: int) -> None:
    self.row = int(row)

  def _load(self, k: int) -> None:
    with np.load(os.path.join(self.dir, f"shard-{k:05d}.npz"), allow_pickle=False) as z:
      self._data = {name: z[name] for name in z.files}
    self._shard = k

  def read(self, n: int) -> dict[str, np.ndarray]:
    """The next n rows {field: (n, ...)}."""
    if self.row + n > self.total:
      raise ValueError(f"{self.dir}: asked for rows [{self.row}, {self.row + n}) of {self.total}")
    parts: list[dict] = []
    row, end = self.row, self.row + n
    while row < end:
      k = int(np.searchsorted(self.starts, row, side="right") - 1)
      if k != self._shard:
        self._load(k)
      lo, hi = row - self.starts[k], min(end, self.starts[k + 1]) - self.starts[k]
      parts.append({name: v[lo:hi] for name, v in self._data.items()})
      row += hi - lo
    self.row = end
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


class KnowledgeSource:
  """A data source whose batches carry the teacher's knowledge: `batch['teacher']`.

  Args:
    source: the data source the knowledge was generated from (same config).
    directory: the knowledge directory.
    check: compare row fingerprints (cheap; off only for benchmarking the reader).
  """

  def __init__(self, source, directory: str, check: bool = True):
    self.source, self.directory, self.check = source, directory, check
    self.index = read_index(directory)
    self.spec = source.spec
    self.fields = {k: v for k, v in self.index["fields"].items()
                   if k not in ("fingerprint", "valid")}

  def describe(self) -> str:
    return f"knowledge({self.directory}) + {self.source.describe()}"

  def __getattr__(self, name):  # shared_vocab, oracle_auc, ... of the wrapped source
    if name in ("source", "index"):
      raise AttributeError(name)
    return getattr(self.source, name)

  def batches(self, batch_size: int, *, process_index: int = 0, process_count: int = 1,
              seed: int = 0, repeat: bool = True, state: dict | None = None):
    idx = self.index
    for k, want in (("batch_size", batch_size), ("process_count", process_count),
                    ("seed", seed)):
      if idx[k] != want:
        raise ValueError(f"knowledge in {self.directory} was generated with {k}={idx[k]}, "
                         f"this run reads it with {k}={want}; regenerate it or match the run")
    return KnowledgeIterator(self, batch_size, process_index, process_count, seed, repeat, state)


class KnowledgeIterator:
  """Source batches zipped with knowledge rows; `state()` is exact (JSON).

  Each epoch is one pass of the source (`repeat=False`, same seed), i.e. the
  pass the knowledge was generated on; with `repeat=True` passes follow each other.
  """

  def __init__(self, ks: KnowledgeSource, batch_size: int, process_index: int,
               process_count: int, seed: int, repeat: bool, state: dict | None):
    self.ks, self.batch_size, self.seed, self.repeat = ks, batch_size, seed, repeat
    self.process_index, self.process_count = process_index, process_count
    self.local = batch_size // process_count
    shard_rows = ks.index["shards"][process_index]
    self.reader = ShardReader(ks.directory, process_index, shard_rows)
    self.epoch, self.batch = 0, 0
    inner = None
    if state is not None:
      self.epoch, self.batch, inner = state["epoch"], state["batch"], state["source"]
    self._open(inner)

  def _open(self, inner_state) -> None:
    self.it = self.ks.source.batches(self.batch_size, process_index=self.process_index,
                                     process_count=self.process_count, seed=self.seed,
                                     repeat=False, state=inner_state)
    self.reader.seek(self.batch * self.local)

  def state(self) -> dict:
    return {"epoch": self.epoch, "batch": self.batch, "source": self.it.state()}

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self.batch >= self.ks.index["num_batches"]:
      if not self.repeat:
        raise StopIteration
      self.epoch, self.batch = self.epoch + 1, 0
      self.close()
      self._open(None)
    batch = next(self.it)
    rows = self.reader.read(len(batch["dense"]))
    if self.ks.check and not np.array_equal(rows["fingerprint"], fingerprint(batch)):
      bad = int(np.argmax(rows["fingerprint"] != fingerprint(batch)))
      raise ValueError(
          f"knowledge row mismatch in {self.ks.directory} (process {self.process_index}, "
          f"epoch {self.epoch}, batch {self.batch}, row {bad}): the data source does not yield "
          "the rows the knowledge was generated on (other files, seed, shuffle or batch size)")
    batch = dict(batch)
    batch["teacher"] = {k: rows[k] for k in list(self.ks.fields) + ["valid"]}
    self.batch += 1
    return batch

  def close(self) -> None:
    if hasattr(self.it, "close"):
      self.it.close()
