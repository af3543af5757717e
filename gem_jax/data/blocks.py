"""Vectorised parsing of blocks of text rows: what the converter's fast readers share.

A reader with a fast path implements `parse_block(data)` for a block of whole lines
as `blocks.parse_block(self, data, fast)`: `fast(data)` parses the block with
pyarrow's CSV reader and numpy and returns (leaves, lines, bad) or None when it
meets anything only the row parser can judge; then the block is parsed row by
row with the reader's own `parse` and `collate`, so both paths agree on every
value and every bad row.

  leaves  {leaf path: array} of the block's good rows (gem_jax.data.columnar.flatten)
  lines   the number of lines in `data`
  bad     [(0-based line in data, reason)] of its bad rows, in order
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
from pyarrow import csv as pa_csv

from gem_jax.data.badrows import BadRow

HEX_LUT = np.full(256, 255, np.uint8)    # ASCII -> hex digit value, 255 for anything else
for _i, _c in enumerate(b"0123456789abcdef"):
  HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
  HEX_LUT[_c] = 10 + _i
MAX_DECIMAL = 10 ** 18                   # the row parsers accept at most 18 digits


def parse_block(source, data: bytes, fast: Callable) -> tuple[dict, int, list]:
  """`fast(data)`, or the row-by-row parse of `source` where it returns None."""
  out = fast(data)
  return out if out is not None else parse_rows(source, data)


def parse_rows(source, data: bytes) -> tuple[dict, int, list]:
  """Row-by-row parse of whole lines with `source.parse` and `source.collate`."""
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
      examples.append(source.parse(line))
    except BadRow as e:
      bad.append((i, str(e)))
  return flatten(source.collate(examples)), len(lines), bad


def read_csv(data: bytes, names: list[str], types: dict, delimiter: str,
             allowed: bytes) -> tuple[pa.Table, int, list] | None:
  """(table, lines, bad) of a block whose rows have `len(names)` fields, or None.

  Only blocks of `allowed` bytes are parsed (pyarrow's int64 parser is laxer than the
  row parsers: it reads ' 7' and '0x10'; its bad-row callback cannot decode non-UTF-8
  bytes; it ends a line at a lone '\\r'). Rows with another field count are skipped
  and reported, whitespace-only lines skipped; empty lines come back as all-null
  rows (`ignore_empty_lines=False` keeps the line count).
  """
  if data.translate(None, allowed) or (b"\r" in data
                                       and data.count(b"\r") != data.count(b"\r\n")):
    return None
  bad, skipped = [], [0]

  def invalid(row):
    skipped[0] += 1
    if row.text.strip():
      bad.append((row.number - 1, f"expected {len(names)} fields separated by "
                                  f"{delimiter.encode()!r}, got {row.actual_columns}"))
    return "skip"

  try:
    t = pa_csv.read_csv(
        pa.py_buffer(data),
        # 1 MB parse blocks (pyarrow's default) stay in cache: 0.9 vs 1.25 us per Criteo row
        # for one 16 MB block; serial reading keeps the bad rows' numbers exact across them
        read_options=pa_csv.ReadOptions(column_names=names, use_threads=False,
                                        block_size=1 << 20),
        parse_options=pa_csv.ParseOptions(delimiter=delimiter, quote_char=False,
                                          ignore_empty_lines=False, invalid_row_handler=invalid),
        convert_options=pa_csv.ConvertOptions(column_types=types, null_values=[""],
                                              strings_can_be_null=False))
  except pa.ArrowInvalid:
    return None
  return t, t.num_rows + skipped[0], bad


def _buffers(col):
  return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def int_column(col) -> tuple[np.ndarray, np.ndarray]:
  """(values with nulls as 0, null mask) of an int64 column, from its buffers."""
  col = _buffers(col)
  n = len(col)
  values = np.frombuffer(col.buffers()[1], np.int64, n, col.offset * 8)
  if col.null_count == 0:
    return values, np.zeros(n, bool)
  valid = np.unpackbits(np.frombuffer(col.buffers()[0], np.uint8), bitorder="little")
  missing = valid[col.offset:col.offset + n] == 0
  return np.where(missing, 0, values), missing


def binary_column(col) -> tuple[np.ndarray, np.ndarray]:
  """(bytes of all values as uint8, lengths) of a binary column."""
  col = _buffers(col)
  n = len(col)
  offsets = np.frombuffer(col.buffers()[1], np.int32, n + 1, col.offset * 4)
  data = np.frombuffer(col.buffers()[2], np.uint8, offsets[-1] - offsets[0], offsets[0])
  return data, np.diff(offsets)


def hex_column(col, width: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
  """(raw int64 ids, lengths) of a binary column of hex ids; '' -> -1.

  Values of 1-16 digits (exactly `width` if given) as `text.parse_hex` reads them
  (int(x, 16)); None if any value is not hex or is >= 2^63 (the row-wise parser then
  names the row).
  """
  data, lengths = binary_column(col)
  n = len(lengths)
  nib = np.take(HEX_LUT, data)                                            # (chars,) 0..15
  if nib.size and nib.max() > 15:
    return None
  if width is not None and not np.all((lengths == width) | (lengths == 0)):
    return None
  if lengths.max(initial=0) > 16:
    return None
  present = lengths > 0
  if width == 8:                        # one big-endian uint32 per value: no scatter
    nib = nib.reshape(-1, 8)
    packed = np.ascontiguousarray((nib[:, 0::2] << 4) | nib[:, 1::2])     # (n', 4)
    values = packed.view(">u4")[:, 0].astype(np.int64)
  else:                                 # right-align every value in 16 digits
    m = int(present.sum())
    rows = np.repeat(np.arange(m), lengths[present])
    starts = np.concatenate([[0], np.cumsum(lengths[present])[:-1]]).astype(np.int64)
    pos = np.arange(len(nib)) - np.repeat(starts, lengths[present])
    grid = np.zeros((m, 16), np.uint8)
    grid[rows, 16 - np.repeat(lengths[present], lengths[present]) + pos] = nib
    packed = np.ascontiguousarray((grid[:, 0::2] << 4) | grid[:, 1::2])   # (n', 8)
    values = packed.view(">u8")[:, 0]
    if values.size and values.max() >> np.uint64(63):
      return None
    values = values.astype(np.int64)
  if len(values) == n:
    return values, lengths
  out = np.full(n, -1, np.int64)
  out[present] = values
  return out, lengths


def all_digits(col) -> bool:
  """Every value of a binary column is 1+ decimal digits."""
  data, lengths = binary_column(col)
  return bool(np.all(lengths > 0) and np.all((data - 48).astype(np.uint8) < 10))
