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
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

from gem_jax.data import text
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
