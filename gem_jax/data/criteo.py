"""Criteo display-ads TSV (Kaggle DAC train.txt, Criteo 1TB day_N), gzip or plain.

Row format (no header, 40 tab-separated fields):

  label \\t I1 .. I13 \\t C1 .. C26

* label: 0/1 click.
* I1..I13: integer (mostly count) features; empty = missing. Dense feature
  `log1p(max(x, 0))`, missing -> 0. With `int_buckets=True` each also becomes a
  sparse feature `B1..B13` with bucket id
    0 missing, 1 for x < 0, 2 + x for x in {0, 1, 2}, 5 + floor(log(x)^2) for x > 2
  (capped at INT_BUCKETS - 1), the Kaggle winners' discretisation.
* C1..C26: 32-bit hashes as exactly 8 hex characters; empty = missing. Raw int64 ids
  (`int(C, 16)`), hashed into their tables by the embedding id policy; missing
  -> -1, i.e. an empty bag.

Bad rows (see badrows.py): a field count other than 40, a label other than
0/1, a non-integer I field, a C field that is not 8 hex digits.

`CriteoSource.parse_block` is the vectorised parser of the converter
(scripts/preprocess.py): pyarrow's CSV reader with explicit column types and a
lookup-table hex decoder, the same values and bad rows as `parse` + `collate`
(a block with a row the fast path cannot decide is re-parsed row by row).
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import csv as pa_csv

from gem_jax.data import text
from gem_jax.data.badrows import BadRow
from gem_jax.data.source import LineSource, base_batch, valid_rows
from gem_jax.data.spec import DataSpec, SparseFeatureSpec

N_INT, N_CAT = 13, 26
N_FIELDS = 1 + N_INT + N_CAT
CAT_WIDTH = 8          # 32-bit hashes, always 8 hex digits: a shorter one is a damaged field
INT_BUCKETS = 256
INT_NAMES = tuple(f"I{i}" for i in range(1, N_INT + 1))
CAT_NAMES = tuple(f"C{i}" for i in range(1, N_CAT + 1))
BUCKET_NAMES = tuple(f"B{i}" for i in range(1, N_INT + 1))
_HEX_LUT = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
  _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
  _HEX_LUT[_c] = 10 + _i
_ROW = re.compile(rb"[01]" + rb"(?:\t(?:-?[0-9]{1,18})?)" * N_INT
                  + rb"(?:\t(?:[0-9a-fA-F]{%d})?)" % CAT_WIDTH * N_CAT)


def int_bucket(x: int | None) -> int:
  """The bucket id of one integer feature value (None = missing)."""
  if x is None:
    return 0
  if x < 0:
    return 1
  if x <= 2:
    return 2 + x
  return min(5 + int(math.log(x) ** 2), INT_BUCKETS - 1)


def int_buckets_of(x: np.ndarray, missing: np.ndarray) -> np.ndarray:
  """`int_bucket` of an int64 array (missing where `missing`), vectorised."""
  with np.errstate(divide="ignore", invalid="ignore"):
    log_sq = np.floor(np.log(np.maximum(x, 3).astype(np.float64)) ** 2).astype(np.int64)
  b = np.where(x < 0, 1, np.where(x <= 2, 2 + x, np.minimum(5 + log_sq, INT_BUCKETS - 1)))
  return np.where(missing, 0, b)


def hex_ids(col: pa.Array) -> np.ndarray | None:
  """Raw ids of a binary column of 8-hex-digit ids ('' -> -1); None if any value is not."""
  col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
  n = len(col)
  offsets = np.frombuffer(col.buffers()[1], np.int32, n + 1, col.offset * 4)
  lengths = np.diff(offsets)
  present = lengths == CAT_WIDTH
  if not np.all(present | (lengths == 0)):
    return None
  data = np.frombuffer(col.buffers()[2], np.uint8, offsets[-1] - offsets[0], offsets[0])
  nib = np.take(_HEX_LUT, data).reshape(-1, CAT_WIDTH)                    # (n', 8) 0..15
  if nib.size and nib.max() > 15:
    return None
  packed = np.ascontiguousarray((nib[:, 0::2] << 4) | nib[:, 1::2])        # (n', 4) bytes
  values = packed.view(">u4")[:, 0].astype(np.int64)  # 8 hex digits: one big-endian uint32
  if len(values) == n:
    return values
  out = np.full(n, -1, np.int64)
  out[present] = values
  return out


def int_column(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
  """(values with nulls as 0, null mask) of an int64 column, from its buffers."""
  col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
  n = len(col)
  values = np.frombuffer(col.buffers()[1], np.int64, n, col.offset * 8)
  if col.null_count == 0:
    return values, np.zeros(n, bool)
  valid = np.unpackbits(np.frombuffer(col.buffers()[0], np.uint8), bitorder="little")
  missing = valid[col.offset:col.offset + n] == 0
  return np.where(missing, 0, values), missing


_ROW_BYTES = b"0123456789abcdefABCDEF-\t\r\n"
_CSV_NAMES = ["label", *INT_NAMES, *CAT_NAMES]
_CSV_TYPES = {"label": pa.int64(), **{n: pa.int64() for n in INT_NAMES},
              **{n: pa.binary() for n in CAT_NAMES}}


def criteo_spec(vocab_size: int = 1 << 20, int_buckets: bool = False) -> DataSpec:
  sparse = [SparseFeatureSpec(n, vocab_size) for n in CAT_NAMES]
  if int_buckets:
    sparse += [SparseFeatureSpec(n, INT_BUCKETS) for n in BUCKET_NAMES]
  return DataSpec(n_dense=N_INT, sparse=tuple(sparse), tasks=("click",))


class CriteoSource(LineSource):
  """Streams Criteo TSV rows as batches (see module docstring).

  Args:
    paths: file(s), comma-separated string or list; globs allowed.
    vocab_size: expected distinct values per categorical (the spec's vocab hint).
    int_buckets: also emit the bucketised integer features B1..B13.
    **kw: StreamingSource options (shuffle_buffer, bad_row_limit, bad_row_min_rows).
  """

  def __init__(self, paths: str | Sequence[str], *, vocab_size: int = 1 << 20,
               int_buckets: bool = False, **kw):
    super().__init__(paths, criteo_spec(vocab_size, int_buckets), **kw)
    self.int_buckets = int_buckets

  @classmethod
  def from_config(cls, cfg, split: str) -> "CriteoSource":
    train = split == "train"
    return cls(cfg.train if train else cfg.eval,
               vocab_size=cfg.get("vocab_size", 1 << 20),
               int_buckets=cfg.get("int_buckets", False),
               shuffle_buffer=cfg.get("shuffle_buffer", 0) if train else 0,
               bad_row_limit=cfg.get("bad_row_limit", 0.01))

  def parse(self, line: bytes):
    """-> (label, ints (13 of int|None), cats (26 raw ids, -1 = missing))."""
    if _ROW.fullmatch(line):      # fast path: one regex validates the whole row
      f = line.split(b"\t")
      return (float(f[0] == b"1"), [int(t) if t else None for t in f[1:14]],
              [int(t, 16) if t else -1 for t in f[14:]])
    f = text.split_fields(line, b"\t", N_FIELDS)   # slow path: find and name the bad field
    label = text.parse_label(f[0])
    ints = [text.parse_int(t, INT_NAMES[j]) if t else None for j, t in enumerate(f[1:14])]
    cats = [text.parse_hex(t, CAT_NAMES[j], CAT_WIDTH) if t else -1 for j, t in enumerate(f[14:])]
    return label, ints, cats

  def parse_block(self, data: bytes) -> tuple[dict, int, list[tuple[int, str]]]:
    """Parses whole lines: (leaves of the good rows (gem_jax.data.columnar.flatten),
    lines in `data`, [(0-based line in `data`, reason)] of the bad rows)."""
    bad: list[tuple[int, str]] = []
    skipped = [0]

    def invalid(row):
      skipped[0] += 1
      if row.text.strip():
        bad.append((row.number - 1, f"expected {N_FIELDS} fields separated by b'\\t', "
                                    f"got {row.actual_columns}"))
      return "skip"

    leaves = None
    # The fast path sees only the bytes of valid rows: pyarrow's int64 parser is laxer than
    # the row parser (it reads ' 7' and '0x10'), its bad-row callback cannot decode
    # non-UTF-8 bytes, and it ends a line at a lone '\r'. Other blocks go row by row.
    if not data.translate(None, _ROW_BYTES) and data.count(b"\r") == data.count(b"\r\n"):
      try:
        t = pa_csv.read_csv(
            pa.py_buffer(data),
            read_options=pa_csv.ReadOptions(column_names=_CSV_NAMES, use_threads=False,
                                            block_size=max(1 << 20, len(data) + 1)),
            parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False,
                                              ignore_empty_lines=False,
                                              invalid_row_handler=invalid),
            convert_options=pa_csv.ConvertOptions(column_types=_CSV_TYPES, null_values=[""],
                                                  strings_can_be_null=False))
        lines = t.num_rows + skipped[0]
        leaves = self._block_leaves(t)
      except pa.ArrowInvalid:
        pass
    if leaves is None:   # something only the row parser can name: parse the block row by row
      return self._parse_block_rows(data)
    return leaves, lines, bad

  def _block_leaves(self, t: pa.Table) -> dict | None:
    label = t.column("label").to_numpy(zero_copy_only=False)
    if np.isnan(label).any():   # a null label: a blank row (skipped) or a bad one
      blank = np.isnan(label)
      for n in (*INT_NAMES, *CAT_NAMES):
        c = t.column(n)
        blank &= (c.is_null().to_numpy(zero_copy_only=False) if n in INT_NAMES
                  else (pc.binary_length(c).to_numpy(zero_copy_only=False) == 0))
      if not np.array_equal(blank, np.isnan(label)):
        return None
      t = t.filter(pa.array(~blank))
      label = t.column("label").to_numpy(zero_copy_only=False)
    label = label.astype(np.int64)
    if not np.all((label == 0) | (label == 1)):
      return None
    n = t.num_rows
    ints = np.zeros((n, N_INT), np.int64)
    missing = np.zeros((n, N_INT), bool)
    for j, name in enumerate(INT_NAMES):
      ints[:, j], missing[:, j] = int_column(t.column(name))
    if n and (ints.max() >= 10 ** 18 or ints.min() <= -10 ** 18):  # the row parser: <= 18 digits
      return None
    leaves = {"dense": np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32),
              "domain": np.zeros(n, np.int32), "labels": label[:, None].astype(np.float32),
              "label_mask": np.ones((n, 1), np.float32)}
    for name in CAT_NAMES:
      ids = hex_ids(t.column(name))
      if ids is None:
        return None
      leaves[f"ids/{name}"] = ids[:, None]                                   # (n, 1)
    if self.int_buckets:
      b = int_buckets_of(ints, missing)                                       # (n, 13)
      leaves.update({f"ids/{name}": b[:, j:j + 1] for j, name in enumerate(BUCKET_NAMES)})
    return leaves

  def _parse_block_rows(self, data: bytes) -> tuple[dict, int, list[tuple[int, str]]]:
    from gem_jax.data.columnar import flatten  # pylint: disable=import-outside-toplevel
    examples, bad = [], []
    lines = data.split(b"\n")
    if lines and not lines[-1]:
      lines.pop()
    for i, line in enumerate(lines):
      line = line.rstrip(b"\r")
      if not line.strip():
        continue
      try:
        examples.append(self.parse(line))
      except BadRow as e:
        bad.append((i, str(e)))
    return flatten(self.collate(examples)), len(lines), bad

  def collate(self, examples: list) -> dict:
    b = len(examples)
    out = base_batch(b, N_INT, 1)
    cats = np.full((b, N_CAT), -1, np.int64)
    buckets = np.full((b, N_INT), -1, np.int64)
    idx, ex = valid_rows(examples)
    if len(idx):
      out["labels"][idx, 0] = [e[0] for e in ex]
      out["label_mask"][idx, 0] = 1.0
      ints = [[max(x, 0) if x is not None else 0 for x in e[1]] for e in ex]
      out["dense"][idx] = np.log1p(np.asarray(ints, np.float64)).astype(np.float32)  # (b', 13)
      cats[idx] = [e[2] for e in ex]                                                   # (b', 26)
      if self.int_buckets:
        buckets[idx] = [[int_bucket(x) for x in e[1]] for e in ex]
    out["ids"] = {n: cats[:, j:j + 1] for j, n in enumerate(CAT_NAMES)}   # (B, 1) each
    if self.int_buckets:
      out["ids"].update({n: buckets[:, j:j + 1] for j, n in enumerate(BUCKET_NAMES)})
    return out
