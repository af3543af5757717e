"""Strict field parsers shared by the readers (bytes in, value out or BadRow).

Python's `int()` accepts surrounding whitespace, underscores and signs; these
parsers do not, so a damaged field is reported instead of silently becoming a
different value.
"""
from __future__ import annotations

import hashlib
import re

from gem_jax.data.badrows import BadRow

_INT = re.compile(rb"-?[0-9]{1,18}")
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")
_FLOAT = re.compile(rb"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def parse_int(tok: bytes, name: str) -> int:
  """A decimal integer (optional '-', at most 18 digits)."""
  if not _INT.fullmatch(tok):
    raise BadRow(f"{name}: non-integer {tok[:32]!r}")
  return int(tok)


def parse_hex(tok: bytes, name: str, width: int | None = None) -> int:
  """A hex id of 1-16 digits (exactly `width` if given) as a non-negative int64 raw id.

  Ids >= 2^63 (16 digits, the first >= 8) do not fit: BadRow, never a merged id."""
  if not _HEX.fullmatch(tok) or (width is not None and len(tok) != width):
    raise BadRow(f"{name}: malformed categorical {tok[:32]!r}")
  v = int(tok, 16)
  if v >> 63:
    raise BadRow(f"{name}: hex id {tok.decode()} is >= 2^63 (raw ids are int64)")
  return v


def parse_float(tok: bytes, name: str) -> float:
  if not _FLOAT.fullmatch(tok):
    raise BadRow(f"{name}: non-numeric {tok[:32]!r}")
  return float(tok)


def parse_label(tok: bytes, name: str = "label") -> float:
  if tok == b"1":
    return 1.0
  if tok == b"0":
    return 0.0
  raise BadRow(f"{name}: expected 0 or 1, got {tok[:32]!r}")


def zigzag(v: int) -> int:
  """Maps signed ints to non-negative raw ids: 0,-1,1,-2,... -> 0,1,2,3,..."""
  return 2 * v if v >= 0 else -2 * v - 1


def string_id(tok: bytes) -> int:
  """A stable non-negative int64 raw id for a categorical string (64-bit blake2b)."""
  return int.from_bytes(hashlib.blake2b(tok, digest_size=8).digest(), "little") >> 1


def decode_utf8(line: bytes) -> str:
  try:
    return line.decode("utf-8")
  except UnicodeDecodeError as e:
    raise BadRow(f"undecodable bytes at column {e.start}: {line[e.start:e.start + 8]!r}") from None


def split_fields(line: bytes, sep: bytes, n: int) -> list[bytes]:
  """Splits and checks the field count."""
  fields = line.split(sep)
  if len(fields) != n:
    raise BadRow(f"expected {n} fields separated by {sep!r}, got {len(fields)}")
  return fields
