"""Multi-process chaos test: `chaos.py --processes 2` (2 processes x 4 CPU devices, loopback).

  python scripts/chaos.py --processes 2 --trials 20 --seed 0

1. An uninterrupted reference run of `tiny` (S steps, a checkpoint every 2) with
   2 processes x 4 devices in WORKDIR/reference.
2. N trials in WORKDIR/chaos. Each launches both processes (the harness is the
   launcher: a fresh coordinator port, the failure-detection timeouts below) and
   sends SIGKILL, SIGTERM or SIGSTOP (a third each) to process 0, process 1 or
   both (40 / 40 / 20 %) at a drawn moment: start-up (0-10 s after the launch),
   restore (once process 0 logs the mesh, before it logs the resume), compile
   (0-30 s after the resume), mid-step (after 1-3 new logged steps and a random
   fraction of a step) or during an async save (a new Orbax temporary directory).
   The phase seen at the signal is recorded. The survivors (processes not killed
   or stopped) must then exit within `exit_bound_s` of the signal; a stopped
   process is a hung host: it is SIGKILLed once the survivors have exited.
3. The next launch must resume from the newest complete checkpoint on disk
   (after a clean SIGTERM stop: the one at the last logged step), both
   processes from the same step; a last launch runs to S.
4. Its losses and final state are compared with the reference: bit for bit, and
   within `TOLERANCE` (two uninterrupted 2 x 4 CPU runs can differ by 1-2 ulps:
   the cross-process reductions are not reproducible bit for bit).

Bound: the step watchdog (`GEM_JAX_STEP_TIMEOUT_S`, a hang in the loop), the
heartbeat timeout (a peer dead or stopped outside the loop) and the start-up
timeout (a peer that never joined) each end a survivor; it must exit within the
largest of them + `EXIT_SLACK_S` (60, 90, 90 + 30 = 120 s). A clean preemption
(SIGTERM held until the first step) is bounded from the later of the signal and
that step. The step timeout covers the slowest legitimate gap between two steps
in a faulted launch: the first save compiles Orbax's slicing programs (20 s was
overrun at a load average of 12 on 2 cores). The reference and the last launch
evaluate (the eval step compiles inside the loop) and have no faults: their step
timeout is `UNFAULTED_STEP_TIMEOUT_S`.

Multi-process launches compile every time: `distributed.py` turns the persistent
cache off with several processes (process 1 finds no entry of process 0's, and
the skew overruns gloo's 30 s rendezvous), so each launch takes minutes here.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import chaos

STEP_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, INIT_TIMEOUT_S = 60, 90, 90
UNFAULTED_STEP_TIMEOUT_S = 900  # the reference and the last launch evaluate (a compile)
EXIT_SLACK_S = 30
EXIT_BOUND_S = max(STEP_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, INIT_TIMEOUT_S) + EXIT_SLACK_S
TOLERANCE = 1e-6  # absolute, losses and float state leaves (fp32 rounding)
DEVICES = 4
SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP)
MOMENTS = (("startup", 0.15), ("restore", 0.15), ("compile", 0.2), ("step", 0.3), ("save", 0.2))
MESH_LINE = "mesh {"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch_env(i: int, n: int, port: int, step_timeout_s: float) -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
              GEM_JAX_COORDINATOR=f"127.0.0.1:{port}", GEM_JAX_NUM_PROCESSES=str(n),
              GEM_JAX_PROCESS_ID=str(i), GEM_JAX_STEP_TIMEOUT_S=str(step_timeout_s),
              GEM_JAX_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
              GEM_JAX_INIT_TIMEOUT_S=str(INIT_TIMEOUT_S), GEM_JAX_SHUTDOWN_TIMEOUT_S="10")


class Launch:
  """The processes of one multi-process start of the trainer, each logging to its file."""

  def __init__(self, workdir: str, steps: int, cache: str, n: int, tag: str,
               step_timeout_s: float = STEP_TIMEOUT_S):
    self.logs = [os.path.join(workdir, "logs", f"{tag}_process_{i}.log") for i in range(n)]
    os.makedirs(os.path.dirname(self.logs[0]), exist_ok=True)
    port, cmd = _free_port(), chaos.child_cmd(workdir, steps, cache)
    self.procs = []
    for i in range(n):
      with open(self.logs[i], "w", encoding="utf-8") as err:
        self.procs.append(subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, env=launch_env(i, n, port, step_timeout_s),
            cwd=chaos.ROOT, start_new_session=True))
    self.t0 = time.monotonic()
    self.exit_t: dict[int, float] = {}

  def log(self, i: int) -> str:
    try:
      with open(self.logs[i], encoding="utf-8", errors="replace") as f:
        return f.read()
    except FileNotFoundError:
      return ""

  def poll(self) -> list[int | None]:
    rcs = [p.poll() for p in self.procs]
    for i, rc in enumerate(rcs):
      if rc is not None and i not in self.exit_t:
        self.exit_t[i] = time.monotonic()
    return rcs

  def running(self) -> bool:
    return any(rc is None for rc in self.poll())

  def kill(self, i: int, sig=signal.SIGKILL) -> None:
    if self.procs[i].poll() is None:
      try:
        os.kill(self.procs[i].pid, sig)
      except ProcessLookupError:
        pass

  def wait_all(self, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while self.running() and time.monotonic() < deadline:
      time.sleep(0.02)
    for i in range(len(self.procs)):
      self.kill(i)
    return [p.wait() for p in self.procs]

  def resumed(self) -> list[int | None]:
    return [int(m.group(1)) if (m := chaos.RESUMED.search(self.log(i))) else None
            for i in range(len(self.procs))]


def _phase(launch: Launch, workdir: str, n_rows: int, old_tmp: set) -> str:
  """What the run was doing: startup, restore, compile, step or save."""
  if chaos.tmp_dirs(os.path.join(workdir, "checkpoints")) - old_tmp:
    return "save"
  if len(chaos.logged_steps(workdir)) > n_rows:
    return "step"
  log0 = launch.log(0)
  fresh = not chaos.complete_steps(os.path.join(workdir, "checkpoints"))  # init, not restore
  if chaos.RESUMED.search(log0) or "train step lowered" in log0 or (fresh and MESH_LINE in log0):
    return "compile"
  return "restore" if MESH_LINE in log0 else "startup"


def _wait_for_moment(rng: random.Random, launch: Launch, workdir: str, n_rows: int,
                     old_tmp: set, moment: str, step_s: float) -> None:
  """Returns at the drawn moment (or when the run ended or passed it)."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  delay, k, frac = rng.uniform(0.0, 10.0), rng.randint(1, 3), rng.random()
  compile_delay = rng.uniform(0.0, 30.0)
  t_resumed = None
  while launch.running():
    now, rows = time.monotonic(), len(chaos.logged_steps(workdir)) - n_rows
    if moment == "startup" and now - launch.t0 >= delay:
      return
    if moment == "restore" and (MESH_LINE in launch.log(0) or rows):
      return
    if moment == "compile":
      if rows:
        return
      if t_resumed is None and (chaos.RESUMED.search(launch.log(0)) or
                                (MESH_LINE in launch.log(0) and n_rows == 0)):
        t_resumed = now
      if t_resumed is not None and now - t_resumed >= compile_delay:
        return
    if moment == "step" and rows >= k:
      time.sleep(frac * step_s)
      return
    if moment == "save" and rows >= k and chaos.tmp_dirs(ckpt_dir) - old_tmp:
      return
    if moment == "save" and rows >= k + 10:  # never caught one in flight
      return
    time.sleep(0.005)


def trial(rng: random.Random, workdir: str, steps: int, cache: str, n: int, step_s: float,
          tag: str) -> dict:
  """One launch, signalled at a drawn moment; what happened."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  expected = max(chaos.complete_steps(ckpt_dir), default=None)
  n_rows = len(chaos.logged_steps(workdir))
  old_tmp = chaos.tmp_dirs(ckpt_dir)
  sig = rng.choice(SIGNALS)
  r = rng.random()
  targets = [0] if r < 0.4 else [1] if r < 0.8 else list(range(n))
  moment = rng.choices([m for m, _ in MOMENTS], [w for _, w in MOMENTS])[0]
  launch = Launch(workdir, steps, cache, n, tag)
  _wait_for_moment(rng, launch, workdir, n_rows, old_tmp, moment, step_s)
  phase = _phase(launch, workdir, n_rows, old_tmp)
  ended_before = not launch.running()
  t_sig = time.monotonic()
  for i in targets:
    launch.kill(i, sig)
  gone = set(targets) if sig in (signal.SIGKILL, signal.SIGSTOP) else set()
  survivors = [i for i in range(n) if i not in gone]
  deadline = t_sig + max(3 * EXIT_BOUND_S, 600)  # then they are killed: a failure
  t_first = t_sig if len(chaos.logged_steps(workdir)) > n_rows else None
  while any(launch.procs[i].poll() is None for i in survivors) and time.monotonic() < deadline:
    launch.poll()
    if t_first is None and len(chaos.logged_steps(workdir)) > n_rows:
      t_first = time.monotonic()
    time.sleep(0.02)
  launch.poll()
  if sig == signal.SIGSTOP:  # the hung host(s): the scheduler kills them now
    time.sleep(0.5 if survivors else 5.0)
  rcs = launch.wait_all(timeout=0)
  rows = chaos.logged_steps(workdir)[n_rows:]
  out = {"expected": expected, "newest_after": max(chaos.complete_steps(ckpt_dir), default=None),
         "resumed": launch.resumed(), "signal": sig, "targets": targets, "moment": moment,
         "phase": phase, "ended_before_signal": ended_before, "rcs": rcs,
         "survivors": survivors, "progressed": bool(rows),
         "last_step": rows[-1][0] if rows else None,
         "during_save": phase == "save",
         "corrupt": sum(launch.log(i).count("corrupt checkpoint") for i in range(n)),
         "clean_stop": sig == signal.SIGTERM and all(rc == 0 for rc in rcs)}
  out["exit_s"] = {i: round(launch.exit_t.get(i, time.monotonic()) - t_sig, 1)
                   for i in survivors}
  if out["clean_stop"] and t_first is not None and t_first > t_sig:  # held until a step
    out["exit_s_after_first_step"] = {i: round(launch.exit_t[i] - t_first, 1)
                                      for i in survivors}
  out["tails"] = [launch.log(i)[-2500:] for i in range(n)]
  return out


def judge(killed: dict, restart: dict) -> tuple[bool, bool]:
  """(restart ok, checkpoint lost) for the launch that followed `killed`."""
  resumed = {r for r in restart["resumed"] if r is not None}
  expected = restart["expected"]
  lost = bool(resumed) and (len(resumed) > 1 or resumed != {expected})
  if expected is not None and not resumed and restart["phase"] not in ("startup", "restore"):
    lost = True  # it got past the restore without resuming
  if killed.get("clean_stop") and killed["last_step"]:
    lost = lost or killed["newest_after"] != killed["last_step"]
  pre_train = restart["phase"] in ("startup", "restore", "compile")
  ok = not lost and (restart["progressed"] or pre_train)
  return ok, lost


def in_bound(r: dict) -> bool:
  """The survivors of trial `r` exited within the bound."""
  if r["clean_stop"]:
    times = r.get("exit_s_after_first_step", r["exit_s"])
  else:
    times = r["exit_s"]
  return all(t <= EXIT_BOUND_S for t in times.values())


def restore_state(workdir: str, step: int):
  """The train state of checkpoint `step` of `workdir` (written by several processes),
  restored in this process on 8 CPU devices with the tiny config's shardings: Orbax
  restores a multi-process checkpoint only into a target tree."""
  os.environ.update(chaos.child_env())
  import importlib.util  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, chaos.ROOT)
  from gem_jax.train import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  from gem_jax.train import setup  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("tiny_config",
                                                os.path.join(chaos.ROOT, "configs", "tiny.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  s = setup.setup(mod.get_config())
  mgr = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None, keep=9)
  try:
    return mgr.restore(setup.checkpoint_abstract(s.abstract, s.plan), step=step).state
  finally:
    mgr.close()


def state_difference(a_dir: str, b_dir: str, step: int) -> tuple[bool, float]:
  """(bit for bit, largest difference) of two runs' states; see chaos.tree_difference."""
  return chaos.tree_difference(restore_state(a_dir, step), restore_state(b_dir, step))


def compare(ref_dir: str, run_dir: str, steps: int) -> dict:
  """Losses and final state of `run_dir` vs `ref_dir`: bit for bit and within TOLERANCE."""
  ref, run = dict(chaos.logged_steps(ref_dir)), chaos.logged_steps(run_dir)
  diffs = [abs(ref[s] - v) for s, v in run if s in ref]
  missing = sorted(set(ref) - {s for s, _ in run})
  bitwise, state_diff = state_difference(ref_dir, run_dir, steps)
  return {"losses_bit_equal": sum(d == 0 for d in diffs), "losses_compared": len(diffs),
          "max_loss_diff": max(diffs, default=float("nan")), "missing_steps": missing,
          "losses_equal": bool(diffs) and not missing and len(diffs) == len(run) and
          max(diffs) <= TOLERANCE,
          "final_state_bitwise": bitwise, "max_state_diff": state_diff,
          "final_state_equal": state_diff <= TOLERANCE}


def run_to_end(workdir: str, steps: int, cache: str, n: int, tag: str) -> dict:
  launch = Launch(workdir, steps, cache, n, tag, UNFAULTED_STEP_TIMEOUT_S)
  rcs = launch.wait_all(timeout=chaos.RUN_TIMEOUT_S)
  return {"rcs": rcs, "resumed": launch.resumed(), "tails": [launch.log(i)[-3000:]
                                                             for i in range(n)],
          "corrupt": sum(launch.log(i).count("corrupt checkpoint") for i in range(n)),
          "seconds": round(time.monotonic() - launch.t0, 1)}


def _report(i: int, trials: int, r: dict) -> None:
  who = "both" if len(r["targets"]) > 1 else f"process {r['targets'][0]}"
  seen = r["phase"] + (", the run had ended" if r["ended_before_signal"] else "")
  held = (f" ({r['exit_s_after_first_step']} s after the first step)"
          if "exit_s_after_first_step" in r else "")
  print(f"trial {i + 1}/{trials}: {signal.Signals(r['signal']).name} to {who} (drawn "
        f"{r['moment']}, seen {seen}), resumed from {r['resumed']}, rcs {r['rcs']}, "
        f"exits {r['exit_s']} s{held}", file=sys.stderr, flush=True)


def main(args) -> dict:
  n, steps = args.processes, args.steps or 2 * args.trials + 10
  rng = random.Random(args.seed)
  root, cache, ref_dir, run_dir = chaos.run_dirs(args.workdir, "gem_jax_chaos_mp_")
  t0 = time.monotonic()
  ref = run_to_end(ref_dir, steps, cache, n, "reference")
  if any(ref["rcs"]):
    raise SystemExit("reference run failed:\n" + "\n----\n".join(ref["tails"]))
  times = [json.loads(line).get("step_time_s") for line in
           open(os.path.join(ref_dir, "metrics.jsonl"), encoding="utf-8") if "step_time_s" in line]
  step_s = max(sorted(times)[len(times) // 2], 0.01)

  results, restarts_ok, lost, corrupt = [], 0, 0, 0
  for i in range(args.trials):
    r = trial(rng, run_dir, steps, cache, n, step_s, f"trial{i + 1:02d}")
    if i > 0:
      ok, was_lost = judge(results[-1], r)
      restarts_ok, lost = restarts_ok + ok, lost + was_lost
    corrupt += r["corrupt"]
    results.append(r)
    _report(i, args.trials, r)
    if not in_bound(r) or (r["clean_stop"] is False and r["signal"] == signal.SIGTERM and
                           r["phase"] in ("step", "save")):
      print("\n----\n".join(r["tails"]), file=sys.stderr)
  expected = max(chaos.complete_steps(os.path.join(run_dir, "checkpoints")), default=None)
  last = run_to_end(run_dir, steps, cache, n, "final")
  final = {"expected": expected, "resumed": last["resumed"], "phase": "step",
           "progressed": not any(last["rcs"])}
  if results:
    ok, was_lost = judge(results[-1], final)
    restarts_ok, lost = restarts_ok + ok, lost + was_lost
  corrupt += last["corrupt"] + bool(any(last["rcs"]))
  if any(last["rcs"]):
    print("\n----\n".join(last["tails"]), file=sys.stderr)
  if args.samples_out:  # before the comparison: the trials are the costly part
    with open(args.samples_out, "w", encoding="utf-8") as f:
      json.dump([{k: v for k, v in r.items() if k != "tails"} for r in results] +
                [{"final": final, "restarts_ok": restarts_ok, "lost": lost}], f)
  cmp = compare(ref_dir, run_dir, steps) if not any(last["rcs"]) else {
      "final_state_equal": False, "losses_equal": False}
  exits = [t for r in results for t in r.get("exit_s_after_first_step", r["exit_s"]).values()]
  out = {
      "trials": args.trials, "restarts_ok": restarts_ok, "checkpoints_lost": lost,
      "corrupt_restores": corrupt, "final_state_equal": cmp["final_state_equal"],
      "losses_equal": cmp["losses_equal"], "steps": steps,
      "sigkills": sum(r["signal"] == signal.SIGKILL for r in results),
      "sigterms": sum(r["signal"] == signal.SIGTERM for r in results),
      "startup_kills": sum(r["phase"] == "startup" for r in results),
      "kills_during_save": sum(r["during_save"] for r in results),
      "seconds": round(time.monotonic() - t0, 1),
      "processes": n, "sigstops": sum(r["signal"] == signal.SIGSTOP for r in results),
      "both_signalled": sum(len(r["targets"]) == n for r in results),
      "phases": {p: sum(r["phase"] == p for r in results) for p, _ in MOMENTS},
      "worst_time_to_exit_s": max(exits, default=0.0), "exit_bound_s": EXIT_BOUND_S,
      "survivors_in_bound": sum(in_bound(r) for r in results),
      **{k: v for k, v in cmp.items() if k not in ("final_state_equal", "losses_equal")},
      "tolerance": TOLERANCE,
  }
  print(json.dumps(out), flush=True)
  if not (args.keep or args.workdir):
    shutil.rmtree(root, ignore_errors=True)
  return out

