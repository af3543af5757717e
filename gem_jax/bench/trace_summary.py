"""Top ops by time from a `jax.profiler` trace of a few steps.

  with capture(logdir):          # jax.profiler trace, perfetto JSON included
    for _ in range(steps): run()
  ops = summarize(logdir, steps)  # [{"op", "ms_per_step", "calls_per_step", "share"}, ...]

On GPU/TPU the ops are the device's own events (the kernels XLA launched, named by their
HLO instruction: `fusion.12`, `gemm_fusion_dot.3`, `all-to-all.1`), so their sum is the
device's busy time. On CPU they are the runtime's thunks on the host threads, minus the
executor's own wrappers; with several simulated devices on few cores their durations
include preemption, so read them as shares, not times.

Each op counts its self time: an event's duration less that of the events nested in it on
the same thread (a CPU `while` or `conditional` thunk spans its body's thunks, which are
events of their own; counting both counted the body twice).
  Example: while.3 [0, 500) holding fusion.1 [10, 210) and fusion.2 [250, 350) ->
  while.3 200, fusion.1 200, fusion.2 100: 500 in all, the loop's span.
"""
from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import json
import os
import re

import jax

# Host-side wrappers (executor, rendezvous, Python): not ops of the program.
_WRAPPERS = re.compile(r"ThunkExecutor|Rendezvous|Wait|\$|Pjit|Execute|LaunchOnDevice|end:|"
                       r"PjRt|TfrtCpu|ParallelLoop|ParseArguments|Handle inputs|python|Python")


@contextlib.contextmanager
def capture(logdir: str):
  """`jax.profiler` trace into `logdir` (TensorBoard layout plus a perfetto JSON)."""
  os.makedirs(logdir, exist_ok=True)
  jax.profiler.start_trace(logdir, create_perfetto_trace=True)
  try:
    yield
  finally:
    jax.profiler.stop_trace()


def _latest_trace(logdir: str) -> str:
  found = sorted(glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True),
                 key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f"no *.trace.json.gz under {logdir} (jax.profiler wrote none)")
  return found[-1]


def _device_pids(events) -> set:
  """Process ids of accelerator timelines ('/device:GPU:0', '/device:TPU:0'), if any."""
  return {e["pid"] for e in events
          if e.get("ph") == "M" and e.get("name") == "process_name"
          and re.search(r"/device:(GPU|TPU)", str(e.get("args", {}).get("name", "")))}


def _self_times(ops: list[dict]) -> list[float]:
  """Self time of each complete event (us): its duration less its direct children's, the
  events that start and end inside it on the same (pid, tid) timeline."""
  self_us = [float(e["dur"]) for e in ops]
  by_thread = collections.defaultdict(list)
  for i, e in enumerate(ops):
    by_thread[(e.get("pid"), e.get("tid"))].append(i)
  for idx in by_thread.values():
    idx.sort(key=lambda i: (float(ops[i]["ts"]), -float(ops[i]["dur"])))  # parents first
    open_: list[tuple[float, int]] = []                                   # (end, index)
    for i in idx:
      ts, end = float(ops[i]["ts"]), float(ops[i]["ts"]) + float(ops[i]["dur"])
      while open_ and open_[-1][0] <= ts:
        open_.pop()
      if open_ and end <= open_[-1][0]:
        self_us[open_[-1][1]] -= float(ops[i]["dur"])
      open_.append((end, i))
  return self_us


def summarize(logdir: str, steps: int) -> list[dict]:
  """Every op by summed self time per step (ms), descending, with its calls per step and
  share of the summed time. `steps`: how many steps the trace holds (to divide by)."""
  events = json.load(gzip.open(_latest_trace(logdir)))["traceEvents"]
  dev = _device_pids(events)
  ops = [e for e in events
         if e.get("ph") == "X" and "dur" in e and "ts" in e
         and (e.get("pid") in dev if dev else not _WRAPPERS.search(e["name"]))]
  total: collections.Counter = collections.Counter()
  calls: collections.Counter = collections.Counter()
  for e, us in zip(ops, _self_times(ops)):
    total[e["name"]] += us
    calls[e["name"]] += 1
  busy = sum(total.values()) or 1.0
  return [{"op": name, "ms_per_step": us / 1e3 / steps, "calls_per_step": calls[name] / steps,
           "share": us / busy}
          for name, us in total.most_common()]


def by_kind(rows: list[dict]) -> dict[str, float]:
  """Shares rolled up by op kind: the name without its numeric suffix (`fusion.12` -> fusion)."""
  out: collections.Counter = collections.Counter()
  for r in rows:
    out[re.sub(r"[.\d]+$", "", r["op"])] += r["share"]
  return dict(out.most_common())


def format_top(rows: list[dict], top: int = 15) -> str:
  rows = rows[:top]
  lines = [f"{'ms/step':>9} {'calls':>6} {'share':>6}  op"]
  lines += [f"{r['ms_per_step']:9.3f} {r['calls_per_step']:6.1f} {100 * r['share']:5.1f}%  "
            f"{r['op'][:90]}" for r in rows]
  return "\n".join(lines)
