"""Avazu mobile-ads CSV (Kaggle CTR prediction `train`), gzip or plain.

Row format (24 comma-separated fields; a first line starting with `id,` is a
header and skipped, so header-less splits work too):

  id, click, hour(YYMMDDHH), C1, banner_pos, site_id, site_domain, site_category,
  app_id, app_domain, app_category, device_id, device_ip, device_model,
  device_type, device_conn_type, C14 .. C21

* click: the 0/1 label. `id` is ignored.
* hour -> sparse `hour_of_day` (0..23) and `day_of_week` (0 = Monday) features,
  and dense `sin/cos(2 pi hour / 24)` (n_dense = 2).
* hex columns (site_*, app_*, device_id, device_ip, device_model): raw int64 ids
  `int(x, 16)`; decimal columns (C1, banner_pos, device_type, device_conn_type,
  C14..C21): raw ids `zigzag(int(x))` (0,-1,1,-2.. -> 0,1,2,3..; C20 uses -1).
* Two domains: app traffic (`site_id == 85f751fd`, Avazu's placeholder site for
  in-app impressions) is domain 1, site traffic domain 0.

The Kaggle `test` file has no click column (23 fields) and is rejected as bad rows.
`AvazuSource.parse_block` is the converter's vectorised parser (gem_jax/data/blocks.py):
the same values and bad rows as `parse` + `collate`.
Bad rows: wrong field count, an id that is not decimal digits, label not 0/1, hour not YYMMDDHH or not a date,
malformed hex or decimal id.
"""
from __future__ import annotations

import datetime
import math
from typing import Sequence

import numpy as np

import pyarrow as pa

from gem_jax.data import blocks, text
from gem_jax.data.badrows import BadRow
from gem_jax.data.source import LineSource, base_batch, valid_rows
from gem_jax.data.spec import DataSpec, SparseFeatureSpec

COLUMNS = ("id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain",
           "site_category", "app_id", "app_domain", "app_category", "device_id",
           "device_ip", "device_model", "device_type", "device_conn_type",
           "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21")
HEX_COLUMNS = frozenset({"site_id", "site_domain", "site_category", "app_id", "app_domain",
                         "app_category", "device_id", "device_ip", "device_model"})
ID_COLUMNS = COLUMNS[3:]                        # the 21 categorical columns
TIME_FEATURES = ("hour_of_day", "day_of_week")
APP_SITE_ID = b"85f751fd"
DOMAINS = ("site", "app")
_HOUR_DIGITS = frozenset(b"0123456789")
_DECIMAL_COLUMNS = tuple(c for c in ID_COLUMNS if c not in HEX_COLUMNS)
_CSV_TYPES = {c: pa.int64() if c in _DECIMAL_COLUMNS else pa.binary() for c in COLUMNS}
_ROW_BYTES = b"0123456789abcdefABCDEF-,\r\n"


def avazu_spec(vocab_size: int = 1 << 20) -> DataSpec:
  sparse = [SparseFeatureSpec(n, vocab_size) for n in ID_COLUMNS]
  sparse += [SparseFeatureSpec("hour_of_day", 24), SparseFeatureSpec("day_of_week", 7)]
  return DataSpec(n_dense=2, sparse=tuple(sparse), num_domains=2, tasks=("click",))


def parse_hour(tok: bytes) -> tuple[int, int]:
  """YYMMDDHH -> (hour_of_day, day_of_week)."""
  if len(tok) != 8 or not set(tok) <= _HOUR_DIGITS:
    raise BadRow(f"hour: expected YYMMDDHH, got {tok[:32]!r}")
  yy, mm, dd, hh = (int(tok[i:i + 2]) for i in (0, 2, 4, 6))
  try:
    day = datetime.date(2000 + yy, mm, dd)
  except ValueError:
    raise BadRow(f"hour: not a date {tok!r}") from None
  if hh > 23:
    raise BadRow(f"hour: hour {hh} > 23 in {tok!r}")
  return hh, day.weekday()


class AvazuSource(LineSource):
  """Streams Avazu CSV rows as two-domain batches (see module docstring).

  Args:
    paths: file(s), comma-separated string or list; globs allowed.
    vocab_size: expected distinct values per categorical (the spec's vocab hint).
    **kw: StreamingSource options (shuffle_buffer, bad_row_limit, bad_row_min_rows).
  """

  is_header = staticmethod(lambda line: line.startswith(b"id,"))
  columns, delimiter = COLUMNS, b","

  def __init__(self, paths: str | Sequence[str], *, vocab_size: int = 1 << 20, **kw):
    super().__init__(paths, avazu_spec(vocab_size), **kw)
    self._parsers = [(i, text.parse_hex if c in HEX_COLUMNS else self._decimal, c)
                     for i, c in enumerate(COLUMNS) if c in ID_COLUMNS]

  @staticmethod
  def _decimal(tok: bytes, name: str) -> int:
    return text.zigzag(text.parse_int(tok, name))

  @classmethod
  def from_config(cls, cfg, split: str) -> "AvazuSource":
    train = split == "train"
    return cls(cfg.train if train else cfg.eval,
               vocab_size=cfg.get("vocab_size", 1 << 20),
               shuffle_buffer=cfg.get("shuffle_buffer", 0) if train else 0,
               bad_row_limit=cfg.get("bad_row_limit", 0.01))

  def parse(self, line: bytes):
    """-> (label, hour_of_day, day_of_week, domain, ids (21 raw ids))."""
    f = text.split_fields(line, b",", len(COLUMNS))
    if not f[0].isdigit():
      raise BadRow(f"id: expected a decimal id, got {f[0][:32]!r}")
    label = text.parse_label(f[1], "click")
    hod, dow = parse_hour(f[2])
    ids = [parse(f[i], name) for i, parse, name in self._parsers]
    return label, hod, dow, int(f[5] == APP_SITE_ID), ids

  def parse_block(self, data: bytes) -> tuple[dict, int, list[tuple[int, str]]]:
    """(leaves of the good rows, lines, bad rows) of whole lines (gem_jax/data/blocks.py)."""
    return blocks.parse_block(self, data, self._fast_block)

  def _fast_block(self, data: bytes):
    read = blocks.read_csv(data, list(COLUMNS), _CSV_TYPES, ",", _ROW_BYTES)
    if read is None:
      return None
    t, lines, bad = read
    n = t.num_rows
    label, label_len = blocks.binary_column(t.column("click"))
    if not (blocks.all_digits(t.column("id")) and np.all(label_len == 1)
            and np.all((label == 48) | (label == 49))):
      return None                      # also a blank line (its fields are empty)
    hour, hour_len = blocks.binary_column(t.column("hour"))
    if not np.all(hour_len == 8) or ((hour - 48).astype(np.uint8) > 9).any():
      return None
    d = (hour.reshape(n, 4, 2).astype(np.int64) - 48) @ np.array([10, 1])   # (n, 4) yy mm dd hh
    yy, mm, dd, hod = d[:, 0], d[:, 1], d[:, 2], d[:, 3]
    if n and ((mm < 1) | (mm > 12) | (dd < 1) | (hod > 23)).any():
      return None
    month = ((2000 + yy - 1970) * 12 + mm - 1).astype("datetime64[M]")
    first = month.astype("datetime64[D]").astype(np.int64)                # days since 1970
    month_days = (month + 1).astype("datetime64[D]").astype(np.int64) - first
    days = first + dd - 1
    if n and (dd > month_days).any():
      return None
    dow = (days + 3) % 7                                  # 1970-01-01 was a Thursday
    ids = {}
    for c in ID_COLUMNS:
      if c in HEX_COLUMNS:
        got = blocks.hex_column(t.column(c))
        if got is None or not got[1].all():
          return None
        ids[c] = got[0]
        if c == "site_id":
          app = (got[0] == int(APP_SITE_ID, 16)) & (got[1] == len(APP_SITE_ID))
      else:
        v, missing = blocks.int_column(t.column(c))
        if missing.any() or (n and (v.max() >= blocks.MAX_DECIMAL
                                    or v.min() <= -blocks.MAX_DECIMAL)):
          return None
        ids[c] = np.where(v >= 0, 2 * v, -2 * v - 1)                    # text.zigzag
    angle = 2 * math.pi * hod.astype(np.float64) / 24
    leaves = {"dense": np.stack([np.sin(angle), np.cos(angle)], -1).astype(np.float32),
              "domain": app.astype(np.int32),
              "labels": (label.astype(np.float32) - 48)[:, None],
              "label_mask": np.ones((n, 1), np.float32),
              "ids/hour_of_day": hod[:, None], "ids/day_of_week": dow[:, None]}
    leaves.update({f"ids/{c}": ids[c][:, None] for c in ID_COLUMNS})
    return leaves, lines, bad

  def collate(self, examples: list) -> dict:
    b = len(examples)
    out = base_batch(b, 2, 1)
    ids = np.full((b, len(ID_COLUMNS) + 2), -1, np.int64)
    idx, ex = valid_rows(examples)
    if len(idx):
      out["labels"][idx, 0] = [e[0] for e in ex]
      out["label_mask"][idx, 0] = 1.0
      hod = np.asarray([e[1] for e in ex], np.float64)
      angle = 2 * math.pi * hod / 24
      out["dense"][idx] = np.stack([np.sin(angle), np.cos(angle)], -1)     # (b', 2)
      out["domain"][idx] = [e[3] for e in ex]
      ids[idx] = [e[4] + [e[1], e[2]] for e in ex]                         # (b', 23)
    names = ID_COLUMNS + TIME_FEATURES
    out["ids"] = {n: ids[:, j:j + 1] for j, n in enumerate(names)}         # (B, 1) each
    return out
