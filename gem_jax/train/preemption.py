"""Preemption: SIGTERM / SIGINT end the run cleanly at a step boundary.

  signal arrives (any time)  ->  recorded (a flag; never any work in the handler)
  after each step            ->  `should_stop(step)`: the same answer on every process
  True                       ->  the loop saves a checkpoint (forced), waits for it to be
                                 on disk and sealed, and returns; exit status 0
  next start                 ->  resumes from that checkpoint (state + data position)

Which mechanism decides, by how the run was started:

* Single process (no `jax.distributed`): a Python handler sets a flag that
  `should_stop` reads at every step (free). A second SIGINT/SIGTERM while the
  first is being honoured takes the default action (Ctrl-C twice stops at once).
* `jax.distributed` initialised (every multi-process run): JAX's own preemption
  service. `jax.distributed.initialize` installs a SIGTERM notifier (C++) in every
  process; a SIGTERM to any one of them is posted to the coordination service,
  all processes report their current step to it in the background, and the next
  step of the fastest one becomes the sync point, where
  `multihost_utils.reached_preemption_sync_point(step)` returns True on every
  process. We leave SIGTERM to JAX: a Python handler would replace the notifier
  (the process would then see only its own signal, never a peer's). No collective
  runs per step. The counter is the global step, as Orbax's CheckpointManager
  (which asks the same question in `should_save`) uses it.
  A SIGTERM that arrives after initialisation but before the loop (restore,
  compilation) is caught by the notifier too, but the sync point was then
  computed from counters of no step of this start and may lie in the past; so
  the first `should_stop` of a start also checks whether the coordination
  service holds a preemption notice and all-gathers that answer (one collective
  per start): if any process saw one, all stop after the first step.
  SIGINT is ours: it is forwarded to the process as SIGTERM (so it reaches the
  notifier); a second SIGINT takes the default action. A second SIGTERM does
  nothing more (JAX's notifier only records it); SIGKILL ends a process at once.
* `jax.distributed` without its preemption service
  (`jax_enable_preemption_service=False`): our handlers, and every
  `check_every` steps all processes all-gather their flags
  (`multihost_utils.process_allgather`, a few bytes) and stop together if any
  is set. With a grace period of G seconds before SIGKILL, pick `check_every`
  steps shorter than G minus the save time.

Tested with real processes in tests/test_multihost_preemption.py (2 processes x
4 CPU devices, SIGTERM to one and to both).
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Sequence

import jax
import numpy as np
from absl import logging


# The key under which JAX's preemption sync manager posts a notice to the
# coordination service (xla/tsl/distributed_runtime/preemption/preemption_sync_manager.cc).
NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


def _jax_client():
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  return distributed.global_state.client


def notice_posted() -> bool:
  """Whether some process's preemption notice has reached the coordination service."""
  try:
    _jax_client().key_value_try_get(NOTICE_KEY)
    return True
  except Exception:  # pylint: disable=broad-except  (not found; or no service)
    return False


def jax_preemption_service() -> bool:
  """Whether `jax.distributed` runs with its preemption sync manager in this process."""
  try:
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover - a JAX without the module
    return False
  state = distributed.global_state
  return state.client is not None and state.preemption_sync_manager is not None


class PreemptionWatcher:
  """Turns SIGTERM/SIGINT into a stop decision that the loop polls at step boundaries.

  Args:
    signals: the signals to catch.
    check_every: steps between collective checks when `jax.distributed` runs
      without its preemption service (otherwise every step is checked, free).
    use_jax_service: use JAX's preemption sync point (default: whenever
      `jax.distributed` is initialised with its preemption service).

  Use as a context manager (restores the previous handlers on exit)::

    with PreemptionWatcher() as stop:
      for step in ...:
        ...
        if stop.should_stop(step):   # once per step, on every process
          save(force=True); wait(); break
  """

  def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
               check_every: int = 1, use_jax_service: bool | None = None):
    self.signals = tuple(signals)
    self.check_every = max(1, int(check_every))
    self.use_jax_service = (jax_preemption_service() if use_jax_service is None
                            else bool(use_jax_service))
    self.received: int | None = None  # the first signal number our handler saw
    self.stopped_at: int | None = None
    self._first = True
    self._previous: dict[int, object] = {}

  def install(self) -> "PreemptionWatcher":
    """Installs the handlers (main thread only; elsewhere this is a no-op with a warning)."""
    if threading.current_thread() is not threading.main_thread():
      logging.warning("preemption handlers not installed: not on the main thread")
      return self
    for sig in self.signals:
      if self.use_jax_service and sig == signal.SIGTERM:
        continue  # JAX's preemption notifier holds SIGTERM
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    if self.received is not None:  # second signal: default action
      self.uninstall()
      signal.raise_signal(signum)
      return
    self.received = signum
    if self.use_jax_service:
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's notifier, which tells every process
    # No logging from a signal handler (it may interrupt a logging call holding its lock).

  def uninstall(self) -> None:
    for sig, prev in self._previous.items():
      signal.signal(sig, prev)
    self._previous.clear()

  @property
  def requested(self) -> bool:
    """Whether this process's own handler has received a signal."""
    return self.received is not None

  def should_stop(self, step: int) -> bool:
    """Whether the run stops after `step` (the same answer on every process).

    Call it after every step, on every process.
    """
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    first, self._first = self._first, False
    if self.use_jax_service:
      stop = bool(multihost_utils.reached_preemption_sync_point(step))
      if first:  # a notice from before the loop: its sync point may have passed
        seen = np.int32(notice_posted())
        flags = multihost_utils.process_allgather(seen) if jax.process_count() > 1 else seen
        stop = stop or bool(np.max(flags))
    elif jax.process_count() == 1:
      stop = self.requested
    elif step % self.check_every:
      return False
    else:
      flags = multihost_utils.process_allgather(np.int32(self.requested))
      stop = bool(np.max(flags))
    if stop and self.stopped_at is None:
      self.stopped_at = step
      if self.received:
        name = signal.Signals(self.received).name
      elif self.use_jax_service:
        name = "preemption notice (SIGTERM) via jax.distributed"
      else:
        name = "another process"
      logging.warning("preempted (%s): stopping after step %d with a checkpoint", name, step)
    return stop

  def __enter__(self) -> "PreemptionWatcher":
    return self.install()

  def __exit__(self, *exc) -> None:
    self.uninstall()
