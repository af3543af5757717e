"""Input files: glob expansion with clear errors, and a seekable line stream.

`LineStream` reads text lines from a list of plain or gzip files in order and
can report and restore its exact position (`{'file', 'offset', 'line'}`: file
index, byte offset of the next line in the uncompressed file, lines read so far
in that file), which is what the iterator state of every line-based reader is
built on. Seeking in a gzip file decompresses from the start of the file up to
the offset (gzip has no random access), so resuming inside a large gzip file
costs one partial re-read of that file.

`count_lines` counts a file's lines (gzip too) in large blocks, without splitting
them: how a line-based source reports its row count before training.
"""
from __future__ import annotations

import glob
import gzip
import io
import os
from typing import Callable, Sequence

GZIP_MAGIC = b"\x1f\x8b"


def expand_paths(patterns: str | Sequence[str], what: str = "input") -> list[str]:
  """Expands comma-separated paths/globs into a sorted, de-duplicated file list.

  Raises FileNotFoundError naming the pattern when a pattern matches nothing,
  and ValueError when a matched file is empty (0 bytes).
  """
  if isinstance(patterns, str):
    patterns = [p for p in patterns.split(",") if p.strip()]
  patterns = [os.path.expanduser(p.strip()) for p in patterns]
  if not patterns:
    raise FileNotFoundError(f"{what}: no input path given")
  files: list[str] = []
  for pat in patterns:
    matched = sorted(glob.glob(pat)) if glob.has_magic(pat) else (
        [pat] if os.path.exists(pat) else [])
    matched = [m for m in matched if os.path.isfile(m)]
    if not matched:
      raise FileNotFoundError(f"{what}: no file matches {pat!r}")
    for m in matched:
      if m not in files:
        files.append(m)
  for f in files:
    if os.path.getsize(f) == 0:
      raise ValueError(f"{what}: file {f!r} is empty")
  return files


def open_binary(path: str) -> io.BufferedIOBase:
  """Opens `path` for binary reading, decompressing gzip (detected by magic bytes)."""
  with open(path, "rb") as f:
    magic = f.read(2)
  if magic == GZIP_MAGIC:
    return gzip.open(path, "rb")
  return open(path, "rb")


def count_lines(path: str, is_header: Callable[[bytes], bool] | None = None,
                block: int = 1 << 20) -> int:
  """Lines of `path` (plain or gzip): newlines, plus a last line without one, less a
  first line for which `is_header(line)` is true.

  Blank lines count (LineStream skips them), and a bad row is a line like any other:
  the count is the number of rows up to those. One read of the file in `block`-byte
  chunks (gzip: one decompression), no per-line work.
  """
  n, last = 0, b"\n"
  with open_binary(path) as f:
    first = f.readline()
    if not first:
      return 0
    skip = is_header is not None and is_header(first.rstrip(b"\r\n"))
    n, last = first.count(b"\n"), first[-1:]
    while chunk := f.read(block):
      n += chunk.count(b"\n")
      last = chunk[-1:]
  return n + (last != b"\n") - int(skip)


class LineStream:
  """Lines of several files in order, as `(path, line_number, bytes)` records.

  Line numbers are 1-based physical line numbers; trailing `\\r\\n`/`\\n` is
  stripped; blank lines are skipped (they are not rows); a first line for which
  `is_header(line)` is true is skipped in every file.

  Args:
    paths: files in reading order.
    is_header: optional predicate on the first line of each file.
  """

  def __init__(self, paths: Sequence[str], is_header: Callable[[bytes], bool] | None = None):
    self.paths = list(paths)
    self.is_header = is_header
    self._file = 0
    self._offset = 0
    self._line = 0
    self._fh = None

  def tell(self) -> dict:
    """Position of the next record (JSON-serialisable)."""
    return {"file": self._file, "offset": self._offset, "line": self._line}

  def seek(self, pos: dict) -> None:
    self.close()
    self._file, self._offset, self._line = int(pos["file"]), int(pos["offset"]), int(pos["line"])

  def close(self) -> None:
    if self._fh is not None:
      self._fh.close()
      self._fh = None

  def __iter__(self):
    return self

  def __next__(self) -> tuple[str, int, bytes]:
    while self._file < len(self.paths):
      if self._fh is None:
        self._fh = open_binary(self.paths[self._file])
        if self._offset:
          self._fh.seek(self._offset)
      raw = self._fh.readline()
      if not raw:
        self.close()
        self._file, self._offset, self._line = self._file + 1, 0, 0
        continue
      self._offset += len(raw)
      self._line += 1
      line = raw.rstrip(b"\r\n")
      if not line.strip():
        continue
      if self._line == 1 and self.is_header is not None and self.is_header(line):
        continue
      return self.paths[self._file], self._line, line
    raise StopIteration
