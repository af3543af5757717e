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

from gem_jax.data import blocks, text
from gem_jax.data.source import LineSource, base_batch, valid_rows
from gem_jax.data.spec import DataSpec, SparseFeatureSpec

N_INT, N_CAT = 13, 26
N_FIELDS = 1 + N_INT + N_CAT
CAT_WIDTH = 8          # 32-bit hashes, always 8 hex digits: a shorter one is a damaged field
INT_BUCKETS = 256
INT_NAMES = tuple(f"I{i}" for i in range(1, N_INT + 1))
CAT_NAMES = tuple(f"C{i}" for i in range(1, N_CAT + 1))
BUCKET_NAMES = tuple(f"B{i}" for i in range(1, N_INT + 1))
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


_ROW_BYTES = b"0123456789abcdefABCDEF-\t\r\n"
_CSV_NAMES = ["label", *INT_NAMES, *CAT_NAMES]
_CSV_TYPES = {"label": pa.binary(), **{n: pa.int64() for n in INT_NAMES},
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

  columns = ("label",) + INT_NAMES + CAT_NAMES  # the raw fields (`field`), tab-separated

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
    """(leaves of the good rows, lines, bad rows) of whole lines (gem_jax/data/blocks.py)."""
    return blocks.parse_block(self, data, self._fast_block)

  def _fast_block(self, data: bytes):
    read = blocks.read_csv(data, _CSV_NAMES, _CSV_TYPES, "\t", _ROW_BYTES)
    if read is None:
      return None
    t, lines, bad = read
    leaves = self._block_leaves(t)
    return None if leaves is None else (leaves, lines, bad)

  def _block_leaves(self, t: pa.Table) -> dict | None:
    label, label_len = blocks.binary_column(t.column("label"))
    if not label_len.all():   # an empty label: a blank row (skipped) or a bad one
      blank = label_len == 0
      for n in (*INT_NAMES, *CAT_NAMES):
        c = t.column(n)
        blank &= (c.is_null().to_numpy(zero_copy_only=False) if n in INT_NAMES
                  else (pc.binary_length(c).to_numpy(zero_copy_only=False) == 0))
      if not np.array_equal(blank, label_len == 0):
        return None
      t = t.filter(pa.array(~blank))
      label, label_len = blocks.binary_column(t.column("label"))
    if not (np.all(label_len == 1) and np.all((label == 48) | (label == 49))):  # b"0" | b"1"
      return None
    label = label.astype(np.int64) - 48
    n = t.num_rows
    ints = np.zeros((n, N_INT), np.int64)
    missing = np.zeros((n, N_INT), bool)
    for j, name in enumerate(INT_NAMES):
      ints[:, j], missing[:, j] = blocks.int_column(t.column(name))
    if n and (ints.max() >= blocks.MAX_DECIMAL or ints.min() <= -blocks.MAX_DECIMAL):
      return None
    leaves = {"dense": np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32),
              "domain": np.zeros(n, np.int32), "labels": label[:, None].astype(np.float32),
              "label_mask": np.ones((n, 1), np.float32)}
    for name in CAT_NAMES:
      ids = blocks.hex_column(t.column(name), CAT_WIDTH)
      if ids is None:
        return None
      leaves[f"ids/{name}"] = ids[0][:, None]                                # (n, 1)
    if self.int_buckets:
      b = int_buckets_of(ints, missing)                                       # (n, 13)
      leaves.update({f"ids/{name}": b[:, j:j + 1] for j, name in enumerate(BUCKET_NAMES)})
    return leaves

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
