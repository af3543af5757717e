"""Step-time statistics and machine-load readings for benchmarks.

A benchmark times each step on its own (the host waits for the step's outputs,
so the figure is the device time of one step plus a dispatch), after warm-up
steps that are not timed. On a shared machine the numbers are only meaningful
next to the load they were measured under, so every result carries the 1-min
load average and the CPU time other processes used meanwhile (`CpuMeter`).
"""
from __future__ import annotations

import dataclasses
import os
import resource
import time
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepStats:
  """Median/min/max/mean of per-step seconds and the derived examples/s.

  examples_per_s = batch_size / median (the TorchRec peer's definition).
  """
  times_s: tuple[float, ...]
  batch_size: int

  @property
  def median_s(self) -> float:
    return float(np.median(self.times_s))

  @property
  def min_s(self) -> float:
    return float(np.min(self.times_s))

  @property
  def max_s(self) -> float:
    return float(np.max(self.times_s))

  @property
  def mean_s(self) -> float:
    return float(np.mean(self.times_s))

  @property
  def examples_per_s(self) -> float:
    return self.batch_size / self.median_s

  def as_dict(self) -> dict[str, float]:
    return {"steps": len(self.times_s), "step_ms_median": 1e3 * self.median_s,
            "step_ms_min": 1e3 * self.min_s, "step_ms_max": 1e3 * self.max_s,
            "step_ms_mean": 1e3 * self.mean_s, "examples_per_s": self.examples_per_s}


def time_steps(step: Callable[[int], object], n: int, block: Callable[[object], object]
               ) -> list[float]:
  """Seconds of each of `n` calls `out = step(i)`, waiting with `block(out)` after each."""
  times = []
  for i in range(n):
    t0 = time.perf_counter()
    block(step(i))
    times.append(time.perf_counter() - t0)
  return times


def loadavg() -> float:
  """1-minute load average of the machine (nan where unavailable)."""
  try:
    return float(os.getloadavg()[0])
  except OSError:
    return float("nan")


def peak_rss_mb() -> float:
  """Peak resident memory of this process in MiB (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class CpuMeter:
  """Cores this process and all others kept busy between construction and `stop()`.

  other_busy_cores = machine busy cores (from /proc/stat) - own cores; well above
  0 means the measurement shared the CPUs with something else.
  """

  def __init__(self):
    self.t0 = time.perf_counter()
    self.own0 = self._own()
    self.sys0 = self._machine()

  @staticmethod
  def _own() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

  @staticmethod
  def _machine() -> float | None:
    try:
      with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
      idle = v[3] + (v[4] if len(v) > 4 else 0)
      return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
      return None

  def stop(self) -> dict[str, float | None]:
    wall = max(time.perf_counter() - self.t0, 1e-9)
    own = (self._own() - self.own0) / wall
    m1 = self._machine()
    other = None if m1 is None or self.sys0 is None else max(0.0, (m1 - self.sys0) / wall - own)
    return {"own_busy_cores": own, "other_busy_cores": other, "loadavg_1m": loadavg()}


def median_of(values: Sequence[float]) -> float:
  vals = [v for v in values if v is not None and np.isfinite(v)]
  return float(np.median(vals)) if vals else float("nan")
