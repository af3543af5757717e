"""Raw files -> the columnar training format (gem_jax/data/columnar.py).

  convert(source, out_dir, kind=..., options=...) -> metadata dict

reads a file source in file order, once, and writes its good rows as Parquet
row groups of `row_group_rows` rows, `rows_per_file` rows per file, then the
metadata file (last, so a directory with a dataset.json is complete).

Three paths, the same rows and bad-row reports:
* vectorised: a line source with `parse_block(data)` (Criteo, Avazu) gets the
  files in blocks of whole lines (`block_bytes`), parsed by `workers` threads
  (pyarrow releases the GIL) and written in order; a source with
  `vectorised_leaves()` (MovieLens: users, sorting and histories need the whole
  file) parses everything at once, or returns None for the row path;
* generated: a source with `leaf_chunks(rows)` (long_history) yields one pass of its
  rows as flat leaves, chunk by chunk (no bad rows);
* row by row: any other source (Alimama, adult, own `StreamingSource`s, and
  MovieLens files with bad rows), through its `open_stream` / `decode` / `collate`.

Bad rows follow the readers' rules (gem_jax/data/badrows.py): counted, the
first ones reported as file:line, and the conversion stops with
`BadRowLimitError` above `bad_row_limit`. The counts and reports go into the
metadata.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq

from gem_jax.data import columnar
from gem_jax.data.badrows import BadRow, BadRowCounter
from gem_jax.data.files import open_binary

log = logging.getLogger(__name__)


class DatasetWriter:
  """Buffers leaves and writes them as row groups of `row_group_rows` rows.

  The column layout is inferred from the first rows (columnar.infer_leaves).
  Files are written under a temporary name and renamed when complete.
  """

  def __init__(self, out_dir: str, spec, *, row_group_rows: int = 65536,
               rows_per_file: int = 1 << 20, compression: str = "lz4"):
    if row_group_rows < 1 or rows_per_file < row_group_rows:
      raise ValueError(f"need 1 <= row_group_rows ({row_group_rows}) <= rows_per_file "
                       f"({rows_per_file})")
    self.out_dir, self.spec = out_dir, spec
    self.row_group_rows = int(row_group_rows)
    self.rows_per_file = int(rows_per_file) // self.row_group_rows * self.row_group_rows
    self.compression = compression
    self.layout: list[columnar.Leaf] | None = None
    self.files: list[dict] = []
    self._pending: list[dict] = []
    self._pending_rows = 0
    self._writer = None
    self._file: dict | None = None
    os.makedirs(out_dir, exist_ok=True)

  def write(self, leaves: dict[str, np.ndarray]) -> None:
    n = len(leaves["domain"])
    if n == 0:
      return
    if self.layout is None:
      self.layout = columnar.infer_leaves(self.spec, leaves)
    why = columnar.check_padding(leaves, self.layout)
    if why:
      raise BadRow(f"cannot store the source's batch: {why}")
    self._pending.append(leaves)
    self._pending_rows += n
    if self._pending_rows >= self.row_group_rows:   # one concatenation, then slices
      joined = self._joined()
      full = self._pending_rows // self.row_group_rows * self.row_group_rows
      for a in range(0, full, self.row_group_rows):
        self._write_group({k: v[a:a + self.row_group_rows] for k, v in joined.items()})
      rest = {k: v[full:] for k, v in joined.items()}
      self._pending = [rest] if len(rest["domain"]) else []
      self._pending_rows -= full

  def _joined(self) -> dict:
    if len(self._pending) == 1:
      return self._pending[0]
    return {k: np.concatenate([p[k] for p in self._pending]) for k in self._pending[0]}

  def _write_group(self, head: dict) -> None:
    rows = len(head["domain"])
    if self._writer is None:
      name = f"part-{len(self.files):05d}.parquet"
      self._file = {"path": name, "rows": 0, "row_groups": []}
      self._writer = pq.ParquetWriter(os.path.join(self.out_dir, name + ".tmp"),
                                      columnar.schema(self.layout),
                                      compression=self.compression,
                                      use_dictionary=dictionary_columns(head),
                                      write_statistics=False)  # no predicate pushdown here
    self._writer.write_table(columnar.to_table(head, self.layout), row_group_size=rows)
    self._file["rows"] += rows
    self._file["row_groups"].append(rows)
    if self._file["rows"] >= self.rows_per_file:
      self._close_file()

  def _close_file(self) -> None:
    self._writer.close()
    tmp = os.path.join(self.out_dir, self._file["path"] + ".tmp")
    final = os.path.join(self.out_dir, self._file["path"])
    os.replace(tmp, final)
    self._file["bytes"] = os.path.getsize(final)
    self.files.append(self._file)
    self._writer, self._file = None, None

  def close(self) -> list[dict]:
    if self._pending_rows:
      self._write_group(self._joined())
      self._pending, self._pending_rows = [], 0
    if self._writer is not None:
      self._close_file()
    return self.files


DICTIONARY_MAX_SHARE = 0.25


def dictionary_columns(leaves: dict[str, np.ndarray], sample: int = 65536) -> list[str]:
  """Columns worth dictionary encoding: at most DICTIONARY_MAX_SHARE distinct values in
  the first `sample` values. High-cardinality id columns (hashed ids: ~1 distinct value
  per row) would fill the dictionary, fall back to plain encoding and pay for both:
  measured 2-4x slower writes on planted 10^5-10^6-value fields."""
  out = []
  for path, x in leaves.items():
    v = np.asarray(x).reshape(-1)[:sample]
    if v.size and np.unique(v).size <= DICTIONARY_MAX_SHARE * v.size:
      out.append(path)
  return out


def line_blocks(path: str, block_bytes: int, is_header=None) -> Iterator[tuple[bytes, int]]:
  """(data, first_line): whole lines of `path` (plain or gzip) in blocks of ~block_bytes,
  and the 1-based line number of the block's first line if the header line was dropped
  (2) or not (1); the line numbers of later blocks follow from the parser's line counts."""
  with open_binary(path) as f:
    first_line = 1
    if is_header is not None:
      head = f.readline()
      if head and is_header(head.rstrip(b"\r\n")):
        first_line, head = 2, b""
    else:
      head = b""
    while True:
      data = head + f.read(block_bytes)
      head = b""
      if not data:
        return
      if not data.endswith(b"\n"):
        data += f.readline()
      yield data, first_line
      first_line = 0


def _vectorised_chunks(source, counter: BadRowCounter, workers: int,
                       block_bytes: int) -> Iterator[dict]:
  """Leaves of `source`'s files, parsed block by block on `workers` threads, in order."""
  is_header = type(source).is_header
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    for path in source.paths:
      inflight: collections.deque = collections.deque()
      line = 1

      def merged():
        nonlocal line
        leaves, n_lines, bad = inflight.popleft().result()
        for i, reason in bad:                 # reports in file order, with file:line
          counter.report(f"{path}:{line + i}", reason)
        counter.good(len(leaves["domain"]))
        counter.check()
        line += n_lines
        return leaves

      for data, first_line in line_blocks(path, block_bytes, is_header):
        line = first_line or line
        inflight.append(pool.submit(source.parse_block, data))
        while len(inflight) > 2 * max(1, workers):
          yield merged()
      while inflight:
        yield merged()


def _row_chunks(source, counter: BadRowCounter, chunk_rows: int) -> Iterator[dict]:
  stream = source.open_stream(0, 0)
  examples = []
  try:
    for rec in stream:
      try:
        examples.append(source.decode(rec))
        counter.good()
      except BadRow as e:
        counter.report(source.where(rec), str(e))
      if len(examples) == chunk_rows:
        counter.check()
        yield columnar.flatten(source.collate(examples))
        examples = []
  finally:
    stream.close()
  if examples:
    yield columnar.flatten(source.collate(examples))


def _generated_chunks(source, counter: BadRowCounter, chunk_rows: int) -> Iterator[dict]:
  for leaves in source.leaf_chunks(chunk_rows):
    counter.good(len(leaves["domain"]))
    yield leaves


def convert(source, out_dir: str, *, kind: str, options: dict | None = None,
            row_group_rows: int = 65536, rows_per_file: int = 1 << 20, workers: int = 1,
            block_bytes: int = 16 << 20, compression: str = "lz4") -> dict:
  """Converts one pass of `source` (file order) into the dataset `out_dir`; returns the
  metadata written to out_dir/dataset.json."""
  source.shuffle_buffer = 0   # file order: the reader shuffles at training time
  counter = BadRowCounter(source.bad_row_limit, min_rows=source.bad_row_min_rows)
  writer = DatasetWriter(out_dir, source.spec, row_group_rows=row_group_rows,
                         rows_per_file=rows_per_file, compression=compression)
  whole = source.vectorised_leaves() if hasattr(source, "vectorised_leaves") else None
  if whole is not None:   # a source that parses all of its files at once (MovieLens)
    counter.good(len(whole["domain"]))
    chunks, parser = [whole], "vectorised"
  elif hasattr(source, "leaf_chunks"):   # generated rows (long_history)
    chunks, parser = _generated_chunks(source, counter, row_group_rows), "generated"
  elif hasattr(source, "parse_block") and hasattr(source, "paths"):
    chunks, parser = _vectorised_chunks(source, counter, workers, block_bytes), "vectorised"
  else:
    chunks, parser = _row_chunks(source, counter, row_group_rows), "rows"
  for leaves in chunks:
    writer.write(leaves)
  counter.check(end_of_pass=True)
  files = writer.close()
  if not files:
    raise BadRow(f"{source.describe()}: no readable rows to convert")
  meta = {
      "format": columnar.FORMAT, "version": columnar.VERSION, "kind": kind,
      "options": {k: v for k, v in (options or {}).items() if k not in columnar.RUN_KEYS},
      "spec": columnar.spec_to_json(source.spec),
      "shared_vocab": getattr(source, "shared_vocab", None),
      "leaves": [leaf.to_json() for leaf in writer.layout],
      "files": files, "rows": sum(f["rows"] for f in files),
      "row_group_rows": row_group_rows, "parser": parser,
      "source": source.describe(), "bad_rows": counter.state(),
  }
  columnar.write_meta(out_dir, meta)
  log.info("%s: %d rows in %d files (%d bad rows)", out_dir, meta["rows"], len(files),
           counter.bad)
  return meta


def convert_config(data_cfg, out_dir: str, splits=("train", "eval"), **kw) -> dict:
  """Converts the raw files of `data_cfg` (a config's `data` block) split by split into
  out_dir/<split>; returns {split: metadata}. `kw`: `convert` options."""
  from gem_jax.data import registry  # pylint: disable=import-outside-toplevel
  options = data_cfg.to_dict() if hasattr(data_cfg, "to_dict") else dict(data_cfg)
  out = {}
  for split in splits:
    if columnar.is_dataset(data_cfg.get(split, "")):
      raise ValueError(f"data.{split}={data_cfg.get(split)!r} is already a converted dataset")
    source = registry.file_source(data_cfg, split)
    out[split] = convert(source, os.path.join(out_dir, split), kind=data_cfg.kind,
                         options=options, **kw)
  return out
