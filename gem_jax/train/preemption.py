"""Preemption: SIGTERM / SIGINT end the run cleanly at a step boundary.

  signal arrives (any time)  ->  handler only sets a flag
  after each step            ->  `should_stop(step)`: the flag, agreed by all processes
  True                       ->  the loop saves a checkpoint (forced), waits for it to be
                                 on disk and sealed, and returns; exit status 0
  next start                 ->  resumes from that checkpoint (state + data position)

A second SIGINT/SIGTERM while the first is being honoured falls back to the
default action (a user pressing Ctrl-C twice gets an immediate stop).

Multi-process: schedulers usually signal every process, but not at the same
instant, and a process that stops alone would hang the others in their next
collective. So the decision is collective: every `check_every` steps all
processes all-gather their flags (`multihost_utils.process_allgather`, a few
bytes) and stop together at that step if any flag is set. Single-process runs
read the flag directly at every step (free). With a grace period of G seconds
before SIGKILL, pick `check_every` steps shorter than G minus the save time.
"""
from __future__ import annotations

import signal
import threading
from typing import Sequence

import jax
import numpy as np
from absl import logging


class PreemptionWatcher:
  """Turns SIGTERM/SIGINT into a flag that the training loop polls at step boundaries.

  Args:
    signals: the signals to catch.
    check_every: steps between collective checks in multi-process runs
      (single-process runs check every step).

  Use as a context manager (restores the previous handlers on exit)::

    with PreemptionWatcher() as stop:
      for step in ...:
        ...
        if stop.should_stop(step):
          save(force=True); wait(); break
  """

  def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
               check_every: int = 1):
    self.signals = tuple(signals)
    self.check_every = max(1, int(check_every))
    self.received: int | None = None  # the first signal number
    self.stopped_at: int | None = None
    self._previous: dict[int, object] = {}

  def install(self) -> "PreemptionWatcher":
    """Installs the handlers (main thread only; elsewhere this is a no-op with a warning)."""
    if threading.current_thread() is not threading.main_thread():
      logging.warning("preemption handlers not installed: not on the main thread")
      return self
    for sig in self.signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    if self.received is not None:  # second signal: default action
      self.uninstall()
      signal.raise_signal(signum)
      return
    self.received = signum
    # No logging from a signal handler (it may interrupt a logging call holding its lock).

  def uninstall(self) -> None:
    for sig, prev in self._previous.items():
      signal.signal(sig, prev)
    self._previous.clear()

  @property
  def requested(self) -> bool:
    """Whether this process has received a signal."""
    return self.received is not None

  def should_stop(self, step: int) -> bool:
    """Whether the run stops after `step` (the same answer on every process)."""
    if jax.process_count() == 1:
      stop = self.requested
    elif step % self.check_every:
      return False
    else:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      flags = multihost_utils.process_allgather(np.int32(self.requested))
      stop = bool(np.max(flags))
    if stop and self.stopped_at is None:
      self.stopped_at = step
      name = signal.Signals(self.received).name if self.received else "another process"
      logging.warning("preempted (%s): stopping after step %d with a checkpoint", name, step)
    return stop

  def __enter__(self) -> "PreemptionWatcher":
    return self.install()

  def __exit__(self, *exc) -> None:
    self.uninstall()
