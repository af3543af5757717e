"""Step watchdog: a thread that ends a process whose training step stalls.

In a multi-process run a peer that hangs (not dies: a dead one is caught by
`jax.distributed`'s heartbeats) leaves every other process blocked in a
collective forever. The loop calls `beat(step)` after every step; if no beat
comes for `timeout_s` seconds the watchdog logs

  [process i/N] step watchdog: no progress for T s after step S (stalled in step S+1)

with the Python stacks of all threads, and ends the process with exit status
`STALL_EXIT_CODE` (non-zero, so an orchestrator restarts the job, which resumes
from the last checkpoint). Every process runs its own watchdog, so each one
reports its own index and step.

`timeout_s` must cover the slowest legitimate gap between two beats (a step,
plus an evaluation with its first compile, plus a checkpoint save). Set it with
`--step_timeout_s` or env GEM_JAX_STEP_TIMEOUT_S; the default is
`DEFAULT_MULTI_PROCESS_TIMEOUT_S` for multi-process runs and off (0) for a single
process.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable

import jax
from absl import flags
from absl import logging

STALL_EXIT_CODE = 75
DEFAULT_MULTI_PROCESS_TIMEOUT_S = 900.0

_TIMEOUT = flags.DEFINE_float(
    "step_timeout_s", None, "exit non-zero when no training step finishes for this long "
    f"(0: off; default {DEFAULT_MULTI_PROCESS_TIMEOUT_S:.0f} with several processes, else off)")


def _exit_stalled(message: str) -> None:
  """Logs `message` with every thread's stack and ends the process at once."""
  logging.error(message)
  sys.stderr.write(message + "\n")
  faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
  sys.stderr.flush()
  os._exit(STALL_EXIT_CODE)  # pylint: disable=protected-access  (no atexit: peers may be gone)


class StepWatchdog:
  """Calls `on_stall(message)` (default: log and exit) if `beat` stops for `timeout_s`.

  Args:
    timeout_s: seconds without a beat that count as a stall; <= 0 disables it.
    step: the step the run starts at (before its first beat).
    process_index, process_count: for the message (default: this JAX process).
    on_stall: what to do with the message (default: `_exit_stalled`).
    poll_s: how often the thread checks (default: timeout / 10, at most 1 s).

  Example::

    watchdog = StepWatchdog(600, step=start_step)
    try:
      for ...:
        state = train_step(state, batch); step += 1
        watchdog.beat(step)
    finally:
      watchdog.stop()
  """

  def __init__(self, timeout_s: float, *, step: int = 0, process_index: int | None = None,
               process_count: int | None = None,
               on_stall: Callable[[str], None] | None = None, poll_s: float | None = None):
    self.timeout_s = float(timeout_s)
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    self._on_stall = on_stall or _exit_stalled
    self._step, self._last = int(step), time.monotonic()
    self._lock = threading.Lock()
    self._stopped = threading.Event()
    self.fired = False
    self._thread = None
    if self.timeout_s > 0:
      self._poll = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
      self._thread = threading.Thread(target=self._watch, daemon=True, name="StepWatchdog")
      self._thread.start()

  @classmethod
  def from_env(cls, step: int = 0, env=None, **kw) -> "StepWatchdog":
    """A watchdog with the timeout from `--step_timeout_s`, GEM_JAX_STEP_TIMEOUT_S or the default."""
    return cls(resolve_timeout_s(env), step=step, **kw)

  @property
  def enabled(self) -> bool:
    return self._thread is not None

  def beat(self, step: int) -> None:
    """Records that `step` finished (call from the training loop)."""
    with self._lock:
      self._step, self._last = int(step), time.monotonic()

  def stop(self) -> None:
    """Stops watching (idempotent); call when the loop ends, normally or not."""
    self._stopped.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=5)

  def _watch(self) -> None:
    while not self._stopped.wait(self._poll):
      with self._lock:
        idle, step = time.monotonic() - self._last, self._step
      if idle > self.timeout_s:
        self.fired = True
        self._on_stall(
            f"[process {self.process_index}/{self.process_count}] step watchdog: no progress "
            f"for {idle:.0f} s after step {step} (stalled in step {step + 1}; timeout "
            f"{self.timeout_s:g} s); exiting with status {STALL_EXIT_CODE}")
        return

  def __enter__(self) -> "StepWatchdog":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def resolve_timeout_s(env=None) -> float:
  """The step timeout: the flag if given, else GEM_JAX_STEP_TIMEOUT_S, else the default."""
  env = os.environ if env is None else env
  if flags.FLAGS.is_parsed() and _TIMEOUT.value is not None:
    return float(_TIMEOUT.value)
  if env.get("GEM_JAX_STEP_TIMEOUT_S") not in (None, ""):
    return float(env["GEM_JAX_STEP_TIMEOUT_S"])
  return DEFAULT_MULTI_PROCESS_TIMEOUT_S if jax.process_count() > 1 else 0.0
