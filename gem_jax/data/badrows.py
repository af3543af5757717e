"""The bad-row policy shared by every file reader.

A row that cannot be parsed (wrong field count, non-numeric integer, malformed
categorical, undecodable bytes, ...) raises `BadRow(reason)` in the reader's
decode function. The pipeline counts it, logs the first few as
`file:line: reason`, and gives its slot in the batch to a padding row
(`label_mask = 0`), so the row never reaches the loss or the metrics. Keeping
the slot (rather than pulling in the next row) keeps the batch composition
independent of parse results: every process cuts the same global batches, and a
resumed iterator replays exactly the same rows.

The run stops with `BadRowLimitError` when

  bad / rows > limit      once rows >= min_rows, or at the end of a pass

so that one early bad row cannot abort a run but a file of garbage does.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class BadRow(ValueError):
  """Raised by a reader's row decoder; the message is the reason."""


class BadRowLimitError(RuntimeError):
  """Too many bad rows: the input is probably not in the expected format."""


class NoDataError(RuntimeError):
  """A pass over the input produced no readable rows."""


class BadRowCounter:
  """Counts good and bad rows and enforces the bad-row limit.

  Args:
    limit: maximal fraction of bad rows (0.01 = 1%).
    min_rows: rows to see before the limit is checked (except at the end of a pass).
    max_reports: bad rows logged as warnings and kept for the error message.
  """

  def __init__(self, limit: float = 0.01, min_rows: int = 1000, max_reports: int = 5):
    if not 0.0 <= limit <= 1.0:
      raise ValueError(f"bad_row_limit must be in [0, 1], got {limit}")
    self.limit = float(limit)
    self.min_rows = int(min_rows)
    self.max_reports = int(max_reports)
    self.rows = 0
    self.bad = 0
    self.reports: list[str] = []

  def good(self, n: int = 1) -> None:
    self.rows += n

  def report(self, where: str, reason: str) -> None:
    """Counts one bad row at `where` (`file:line`)."""
    self.rows += 1
    self.bad += 1
    if len(self.reports) < self.max_reports:
      msg = f"{where}: {reason}"
      self.reports.append(msg)
      log.warning("bad row skipped: %s", msg)
      if len(self.reports) == self.max_reports:
        log.warning("further bad rows are counted but not reported")

  def check(self, end_of_pass: bool = False) -> None:
    """Raises BadRowLimitError if the bad fraction is over the limit."""
    if self.rows == 0 or (self.rows < self.min_rows and not end_of_pass):
      return
    frac = self.bad / self.rows
    if frac > self.limit:
      raise BadRowLimitError(
          f"{self.bad} of {self.rows} rows are bad ({frac:.2%}), over bad_row_limit "
          f"{self.limit:.2%}; first ones:\n  " + "\n  ".join(self.reports))

  def state(self) -> dict:
    return {"rows": self.rows, "bad": self.bad, "reports": list(self.reports)}

  def restore(self, state: dict) -> None:
    self.rows = int(state["rows"])
    self.bad = int(state["bad"])
    self.reports = list(state["reports"])
