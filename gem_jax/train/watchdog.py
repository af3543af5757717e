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

Naming the stalled peer: under `jax.distributed` every process also publishes
its last finished step and a wall-clock time stamp to the coordination service's
key-value store every `timeout_s / 5` seconds (at most 10 s), from a thread of
its own (so the reported step can lag by one period). When the watchdog fires it reads every peer's entry (waiting
at most a few seconds: the service runs in process 0, which may itself be the
stalled one) and appends them to the message, e.g.

  ...; stalled: process 1 (silent for 12 s, last reported step 7); alive: none

A peer is "silent" when its entry is older than three publishing periods: it is
stopped, swapped out or wedged as a whole (a SIGSTOP, a frozen host). A peer
that is alive but stuck in its own step keeps publishing; its own watchdog then
names it (its step is the lowest). Time stamps are compared across hosts, so
their clocks must agree to well under a publishing period (NTP does).

`timeout_s` must cover the slowest legitimate gap between two beats (a step,
plus an evaluation with its first compile, plus a checkpoint save). Set it with
`--step_timeout_s` or env GEM_JAX_STEP_TIMEOUT_S; the default is
`DEFAULT_MULTI_PROCESS_TIMEOUT_S` for multi-process runs and off (0) for a single
process.
"""
from __future__ import annotations

import faulthandler
import json
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


PEER_KEY_PREFIX = "gem_jax/watchdog/process/"


class PeerBoard:
  """Every process's last finished step and time of life, in a shared key-value store.

  Args:
    kv_set, kv_dir: `kv_set(key, value)` (overwriting) and `kv_dir(prefix) ->
      [(key, value)]` of a store every process reaches (`from_jax`: the
      `jax.distributed` client's key-value store).
    process_index, process_count: this process and the run's size.
    clock: wall-clock seconds (comparable across hosts).
  """

  def __init__(self, kv_set: Callable[[str, str], None],
               kv_dir: Callable[[str], list], process_index: int, process_count: int,
               clock: Callable[[], float] = time.time):
    self._set, self._dir = kv_set, kv_dir
    self.process_index, self.process_count = process_index, process_count
    self._clock = clock

  @classmethod
  def from_jax(cls) -> "PeerBoard | None":
    """A board on `jax.distributed`'s coordination service, or None if it is not running."""
    try:
      from jax._src import distributed  # pylint: disable=import-outside-toplevel
      client = distributed.global_state.client
    except ImportError:  # pragma: no cover
      return None
    if client is None or jax.process_count() < 2:
      return None
    return cls(lambda k, v: client.key_value_set(k, v, allow_overwrite=True),
               client.key_value_dir_get, jax.process_index(), jax.process_count())

  def publish(self, step: int) -> None:
    """Records that this process is alive and has finished `step`."""
    self._set(f"{PEER_KEY_PREFIX}{self.process_index}",
              json.dumps({"step": int(step), "time": self._clock()}))

  def read(self) -> dict[int, dict]:
    """{process index: {'step', 'time'}} for every process that has published."""
    out = {}
    for key, value in self._dir(PEER_KEY_PREFIX):
      try:
        out[int(key.rsplit("/", 1)[-1])] = json.loads(value)
      except (ValueError, TypeError):
        continue
    return out

  def describe(self, stale_s: float, wait_s: float) -> str:
    """The peers' states for a stall message; waits at most `wait_s` for the store."""
    box: dict = {}

    def fetch():
      try:
        box["peers"] = self.read()
      except Exception as e:  # pylint: disable=broad-except  (a dead service: report it)
        box["error"] = e
    reader = threading.Thread(target=fetch, daemon=True, name="StepWatchdogPeers")
    reader.start()
    reader.join(wait_s)
    if "peers" not in box:
      why = (f"failed: {box['error']}" if "error" in box else
             f"did not answer within {wait_s:g} s")
      return (f"peer states unknown (the coordination service {why}; it runs in process 0, "
              "which may be the stalled one)")
    now, stalled, alive = self._clock(), [], []
    for p in range(self.process_count):
      if p == self.process_index:
        continue
      e = box["peers"].get(p)
      if e is None:
        stalled.append(f"process {p} (never reported)")
        continue
      age = now - float(e["time"])
      if age > stale_s:
        stalled.append(
            f"process {p} (silent for {age:.0f} s, last reported step {e['step']})")
      else:
        alive.append(f"process {p} (last reported step {e['step']})")
    return f"stalled: {', '.join(stalled) or 'none'}; alive: {', '.join(alive) or 'none'}"


class StepWatchdog:
  """Calls `on_stall(message)` (default: log and exit) if `beat` stops for `timeout_s`.

  Args:
    timeout_s: seconds without a beat that count as a stall; <= 0 disables it.
    step: the step the run starts at (before its first beat).
    process_index, process_count: for the message (default: this JAX process).
    on_stall: what to do with the message (default: `_exit_stalled`).
    poll_s: how often the thread checks (default: timeout / 10, at most 1 s).
    board: where processes publish their progress, to name a stalled peer
      (default for `from_env`: `PeerBoard.from_jax()`; None: no peer report).
    publish_s: how often this process publishes to `board` (default: timeout / 5,
      at most 10 s); a peer silent for 3 periods counts as stalled.

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
               on_stall: Callable[[str], None] | None = None, poll_s: float | None = None,
               board: PeerBoard | None = None, publish_s: float | None = None):
    self.timeout_s = float(timeout_s)
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    self._on_stall = on_stall or _exit_stalled
    self._step, self._last = int(step), time.monotonic()
    self._lock = threading.Lock()
    self._stopped = threading.Event()
    self.fired = False
    self._thread = self._publisher = None
    self.board = board
    if self.timeout_s > 0:
      self._poll = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
      self.publish_s = publish_s if publish_s is not None else min(10.0, self.timeout_s / 5)
      if board is not None:
        # Its own thread: a store that does not answer must never block the watchdog.
        self._publisher = threading.Thread(target=self._publish, daemon=True,
                                           name="StepWatchdogPublish")
        self._publisher.start()
      self._thread = threading.Thread(target=self._watch, daemon=True, name="StepWatchdog")
      self._thread.start()

  @classmethod
  def from_env(cls, step: int = 0, env=None, **kw) -> "StepWatchdog":
    """A watchdog with the timeout from `--step_timeout_s`, GEM_JAX_STEP_TIMEOUT_S or the
    default, reporting peers through `jax.distributed` when it runs."""
    timeout = resolve_timeout_s(env)
    if "board" not in kw and timeout > 0:
      kw["board"] = PeerBoard.from_jax()
    return cls(timeout, step=step, **kw)

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

  def _publish(self) -> None:
    while True:
      with self._lock:
        step = self._step
      try:
        self.board.publish(step)
      except Exception as e:  # pylint: disable=broad-except  (the service may be gone)
        logging.warning("step watchdog: could not publish progress: %s", e)
      if self._stopped.wait(self.publish_s):
        return

  def _watch(self) -> None:
    while not self._stopped.wait(self._poll):
      with self._lock:
        idle, step = time.monotonic() - self._last, self._step
      if idle > self.timeout_s:
        self.fired = True
        peers = ""
        if self.board is not None:
          peers = "; " + self.board.describe(stale_s=3 * self.publish_s,
                                             wait_s=min(5.0, self.timeout_s / 2))
        self._on_stall(
            f"[process {self.process_index}/{self.process_count}] step watchdog: no progress "
            f"for {idle:.0f} s after step {step} (stalled in step {step + 1}; timeout "
            f"{self.timeout_s:g} s){peers}; exiting with status {STALL_EXIT_CODE}")
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
