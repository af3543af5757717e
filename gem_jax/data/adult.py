"""UCI Adult (census income) as a two-task example, gzip or plain.

Row format (no header, 15 fields separated by ', '; `?` = missing; the test
split's label has a trailing '.'):

  age, workclass, fnlwgt, education, education_num, marital_status, occupation,
  relationship, race, sex, capital_gain, capital_loss, hours_per_week,
  native_country, income

Two tasks, as in the MMoE examples built on this data:
  task 0 `income`:        income is '>50K' (or '>50K.')
  task 1 `never_married`: marital_status == 'Never-married'
`marital_status` is a label here, so it is not a feature. `relationship` stays a
feature although it correlates with task 1 (e.g. Husband/Wife imply married):
that makes task 1 easy, which is fine for a two-task smoke example.

Features: 6 dense, each a fixed monotone transform to about [0, 1]:
  age/100, log1p(fnlwgt)/15, education_num/16, log1p(capital_gain)/12,
  log1p(capital_loss)/9, hours_per_week/100;
7 sparse strings (workclass, education, occupation, relationship, race, sex,
native_country) as stable 64-bit raw ids (blake2b of the text); `?` -> -1.
Single domain. Bad rows: wrong field count, non-numeric numbers, an income that
is neither '<=50K' nor '>50K', undecodable (non-UTF-8) bytes.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from gem_jax.data import text
from gem_jax.data.badrows import BadRow
from gem_jax.data.source import LineSource, base_batch, valid_rows
from gem_jax.data.spec import DataSpec, SparseFeatureSpec

COLUMNS = ("age", "workclass", "fnlwgt", "education", "education_num", "marital_status",
           "occupation", "relationship", "race", "sex", "capital_gain", "capital_loss",
           "hours_per_week", "native_country", "income")
DENSE = {"age": lambda x: x / 100, "fnlwgt": lambda x: math.log1p(x) / 15,
         "education_num": lambda x: x / 16, "capital_gain": lambda x: math.log1p(x) / 12,
         "capital_loss": lambda x: math.log1p(x) / 9, "hours_per_week": lambda x: x / 100}
SPARSE = ("workclass", "education", "occupation", "relationship", "race", "sex",
          "native_country")
TASKS = ("income", "never_married")
_COL = {c: i for i, c in enumerate(COLUMNS)}


def adult_spec(vocab_size: int = 1024) -> DataSpec:
  return DataSpec(n_dense=len(DENSE), sparse=tuple(SparseFeatureSpec(n, vocab_size)
                                                   for n in SPARSE), tasks=TASKS)


class AdultSource(LineSource):
  """Streams UCI adult rows as two-task batches (see module docstring).

  Args:
    paths: file(s), comma-separated string or list; globs allowed.
    vocab_size: the spec's vocab hint per categorical (the largest, native_country, has 41).
    **kw: StreamingSource options (shuffle_buffer, bad_row_limit, bad_row_min_rows).
  """

  def __init__(self, paths: str | Sequence[str], *, vocab_size: int = 1024, **kw):
    super().__init__(paths, adult_spec(vocab_size), **kw)

  @classmethod
  def from_config(cls, cfg, split: str) -> "AdultSource":
    train = split == "train"
    return cls(cfg.train if train else cfg.eval,
               vocab_size=cfg.get("vocab_size", 1024),
               shuffle_buffer=cfg.get("shuffle_buffer", 0) if train else 0,
               bad_row_limit=cfg.get("bad_row_limit", 0.01))

  def parse(self, line: bytes):
    """-> (labels (2,), dense (6,), ids (7,))."""
    f = text.split_fields(text.decode_utf8(line).encode(), b",", len(COLUMNS))
    f = [t.strip() for t in f]
    income = f[_COL["income"]].rstrip(b".")
    if income not in (b">50K", b"<=50K"):
      raise BadRow(f"income: expected <=50K or >50K, got {income[:32]!r}")
    labels = (float(income == b">50K"), float(f[_COL["marital_status"]] == b"Never-married"))
    dense = []
    for name, fn in DENSE.items():
      v = text.parse_int(f[_COL[name]], name)
      if v < 0:
        raise BadRow(f"{name}: negative value {v}")
      dense.append(fn(v))
    ids = [-1 if f[_COL[n]] == b"?" else text.string_id(f[_COL[n]]) for n in SPARSE]
    return labels, dense, ids

  def collate(self, examples: list) -> dict:
    b = len(examples)
    out = base_batch(b, len(DENSE), len(TASKS))
    ids = np.full((b, len(SPARSE)), -1, np.int64)
    idx, ex = valid_rows(examples)
    if len(idx):
      out["labels"][idx] = [e[0] for e in ex]             # (b', 2)
      out["label_mask"][idx] = 1.0
      out["dense"][idx] = [e[1] for e in ex]              # (b', 6)
      ids[idx] = [e[2] for e in ex]                       # (b', 7)
    out["ids"] = {n: ids[:, j:j + 1] for j, n in enumerate(SPARSE)}
    return out
