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

Files that change under a running reader: each file's size and modification time
are recorded (`fingerprint`: by the source when it is built, else at the stream's
first open of the file) and checked whenever the file is opened (every block of the
shuffle buffer reopens it), when a position is taken (`tell`, at each block end)
and at the file's end. A file that disappeared, shrank, grew or was replaced raises
`InputFileError` naming it and what changed, before any row read after the change
reaches a batch; once the file is back as it was, a restart resumes at the exact
row of its last checkpoint.
"""
from __future__ import annotations

import glob
import gzip
import io
import os
import time
import zlib
from typing import Callable, Mapping, Sequence

GZIP_MAGIC = b"\x1f\x8b"
_RESUME = ("put it back as it was and restart: the run resumes from its last checkpoint "
           "at the exact row")


class InputFileError(RuntimeError):
  """An input file that disappeared, changed or became unreadable while a run read it."""


def fingerprint(path: str) -> tuple[int, int]:
  """(size in bytes, modification time in ns) of `path`."""
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns


def _when(ns: int) -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns % 10**9:09d} UTC"


def check_unchanged(path: str, want: tuple[int, int]) -> None:
  """Raises InputFileError naming `path` and what changed unless it still has the
  `fingerprint` `want`."""
  try:
    got = fingerprint(path)
  except FileNotFoundError:
    raise InputFileError(f"input file {path} disappeared while it was being read (deleted "
                         f"or moved?); {_RESUME}") from None
  if got == tuple(want):
    return
  (s0, m0), (s1, m1) = want, got
  what = []
  if s1 != s0:
    what.append(f"size {s0} -> {s1} bytes ({'truncated' if s1 < s0 else 'grew'})")
  if m1 != m0:
    what.append(f"modified {_when(m0)} -> {_when(m1)}")
  raise InputFileError(f"input file {path} changed while it was being read: "
                       f"{', '.join(what)}; {_RESUME}")


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
    fingerprints: {path: `fingerprint(path)`} the files must keep (the module doc);
      a file not in it is fingerprinted when the stream first opens it.
  """

  def __init__(self, paths: Sequence[str], is_header: Callable[[bytes], bool] | None = None,
               fingerprints: Mapping[str, tuple[int, int]] | None = None):
    self.paths = list(paths)
    self.is_header = is_header
    self.fingerprints = dict(fingerprints or {})
    self._file = 0
    self._offset = 0
    self._line = 0
    self._fh = None

  def tell(self) -> dict:
    """Position of the next record (JSON-serialisable); InputFileError if the open file
    changed (a position in it would mean nothing)."""
    if self._fh is not None:
      self._check()
    return {"file": self._file, "offset": self._offset, "line": self._line}

  def _check(self) -> None:
    path = self.paths[self._file]
    check_unchanged(path, self.fingerprints[path])

  def _open(self) -> None:
    path = self.paths[self._file]
    try:
      if path not in self.fingerprints:
        self.fingerprints[path] = fingerprint(path)
      self._fh = open_binary(path)
    except FileNotFoundError:
      self._fh = None
      raise InputFileError(f"input file {path} disappeared while it was being read (deleted "
                           f"or moved?); {_RESUME}") from None
    self._check()
    if self._offset:
      self._seek(path)

  def _seek(self, path: str) -> None:
    try:
      self._fh.seek(self._offset)
    except (EOFError, OSError, zlib.error) as e:
      self._check()
      e.add_note(f"input file {path}: cannot seek to byte {self._offset}")
      raise

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
        self._open()
      try:
        raw = self._fh.readline()
      except (EOFError, OSError, zlib.error) as e:   # a truncated or damaged gzip stream
        self._check()      # changed meanwhile: InputFileError; else damaged from the start
        e.add_note(f"input file {self.paths[self._file]}: unreadable after byte {self._offset}")
        raise
      if not raw:
        self._check()     # a file cut short ends early: not the end of its rows
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
