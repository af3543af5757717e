"""The source protocol every reader implements, and the base for line-based files.

A source has `.spec` (a `DataSpec`) and

  .batches(batch_size, *, process_index=0, process_count=1, seed=0,
           repeat=True, state=None) -> iterator of host batches with .state()

and optionally `.num_rows() -> int | None`, the rows of one pass (None: it cannot
tell), which `train.epochs` turns into steps (gem_jax.train.setup.resolve_steps).

To plug in one's own logs, subclass `StreamingSource` and provide

  open_stream(epoch, seed) -> RecordStream   records in file order (tell/seek/next/close)
  decode(record) -> example                  raise BadRow(reason) for a bad row
  where(record) -> str                       'file:line' for bad-row reports
  collate(examples) -> batch dict            examples: list of example or None (padding)
  columns / field(record, name) -> str       optional: raw named columns (predict's key)

or, for one-row-per-line text files, subclass `LineSource` and provide
`parse(line: bytes) -> example` and `collate`. Shuffling, process sharding,
bad-row accounting, padding and exact resume then come from
`gem_jax.data.pipeline.BatchIterator`.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gem_jax.data.files import LineStream, count_lines, expand_paths, fingerprint
from gem_jax.data.pipeline import BatchIterator
from gem_jax.data.spec import DataSpec


class StreamingSource:
  """Base class: `batches()` on top of `open_stream` / `decode` / `collate`.

  Args:
    spec: the DataSpec of the batches.
    shuffle_buffer: block-shuffle size in records (<= 1: file order).
    bad_row_limit: maximal bad-row fraction before the run stops.
    bad_row_min_rows: rows read before the limit applies (except at pass end).
  """

  def __init__(self, spec: DataSpec, *, shuffle_buffer: int = 0,
               bad_row_limit: float = 0.01, bad_row_min_rows: int = 1000):
    self.spec = spec
    self.shuffle_buffer = int(shuffle_buffer)
    self.bad_row_limit = float(bad_row_limit)
    self.bad_row_min_rows = int(bad_row_min_rows)

  # -- to implement --------------------------------------------------------------
  def open_stream(self, epoch: int, seed: int):
    raise NotImplementedError

  def decode(self, record) -> Any:
    raise NotImplementedError

  def where(self, record) -> str:
    return "?"

  columns: tuple[str, ...] = ()  # raw columns `field` can return (predict's key column)

  def field(self, record, name: str) -> str:
    """The raw text of column `name` of `record` ('' where the row has no such field)."""
    raise ValueError(f"{self.describe()} has no named raw columns (asked for {name!r})")

  def collate(self, examples: list) -> dict:
    raise NotImplementedError

  def describe(self) -> str:
    return type(self).__name__

  def num_rows(self) -> int | None:
    """Rows of one pass, or None when the source cannot tell without reading it (default)."""
    return None

  # -- provided --------------------------------------------------------------------
  def batches(self, batch_size: int, *, process_index: int = 0, process_count: int = 1,
              seed: int = 0, repeat: bool = True, state: dict | None = None) -> BatchIterator:
    """Host batches of `batch_size // process_count` rows (see pipeline.BatchIterator)."""
    return BatchIterator(
        self, batch_size, process_index=process_index, process_count=process_count,
        seed=seed, repeat=repeat, shuffle_buffer=self.shuffle_buffer,
        bad_row_limit=self.bad_row_limit, bad_row_min_rows=self.bad_row_min_rows,
        state=state)


class LineSource(StreamingSource):
  """A source with one row per text line, from one or many (gzip or plain) files.

  Files are checked at construction (missing or empty: clear error) and their
  size and modification time recorded: a file that changes, shrinks or disappears
  later raises `files.InputFileError` naming it (gem_jax/data/files.py). When
  shuffling, the file order is permuted per epoch with rng((seed, epoch)).
  Records are `(path, line_number, raw_bytes)`.
  """

  is_header = None  # optional predicate: skip a matching first line in every file
  delimiter = b"\t"  # field separator of the raw `columns` (`field`)

  def __init__(self, paths: str | Sequence[str], spec: DataSpec, **kw):
    super().__init__(spec, **kw)
    self.paths = expand_paths(paths, what=type(self).__name__)
    self.fingerprints = {p: fingerprint(p) for p in self.paths}

  def describe(self) -> str:
    return f"{type(self).__name__}({', '.join(self.paths)})"

  def num_rows(self) -> int:
    """Lines of the files (header lines excluded), counted once and cached.

    An approximation of the rows of one pass: blank lines and bad rows (which the
    reader skips) count too. Costs one read of the files (gzip: one decompression).
    """
    if getattr(self, "_num_rows", None) is None:
      self._num_rows = sum(count_lines(p, type(self).is_header) for p in self.paths)
    return self._num_rows

  def open_stream(self, epoch: int, seed: int) -> LineStream:
    order = list(self.paths)
    if self.shuffle_buffer > 1 and len(order) > 1:
      perm = np.random.default_rng((int(seed), int(epoch))).permutation(len(order))
      order = [order[i] for i in perm]
    return LineStream(order, is_header=type(self).is_header, fingerprints=self.fingerprints)

  def decode(self, record):
    return self.parse(record[2])

  def where(self, record) -> str:
    return f"{record[0]}:{record[1]}"

  def field(self, record, name: str) -> str:
    if name not in self.columns:
      raise ValueError(f"{self.describe()}: no column {name!r}; columns: {list(self.columns)}")
    parts = record[2].rstrip(b"\r\n").split(self.delimiter)
    i = self.columns.index(name)
    return parts[i].decode("utf-8", "replace") if i < len(parts) else ""

  def parse(self, line: bytes):
    raise NotImplementedError


def base_batch(b: int, n_dense: int, n_tasks: int) -> dict:
  """An all-padding batch of b rows (dense 0, labels 0, label_mask 0, domain 0)."""
  return {
      "dense": np.zeros((b, n_dense), np.float32),
      "ids": {},
      "seq": {},
      "domain": np.zeros((b,), np.int32),
      "labels": np.zeros((b, n_tasks), np.float32),
      "label_mask": np.zeros((b, n_tasks), np.float32),
  }


def valid_rows(examples: list) -> tuple[np.ndarray, list]:
  """Indices of the non-padding examples and those examples."""
  idx = [i for i, e in enumerate(examples) if e is not None]
  return np.asarray(idx, np.int64), [examples[i] for i in idx]
