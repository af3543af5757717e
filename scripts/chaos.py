"""Chaos test of the trainer: kill `tiny` training at random moments, restart, compare.

  python scripts/chaos.py --trials 20 --seed 0
  python scripts/chaos.py --processes 2 --trials 20 --seed 0   # scripts/chaos_multiprocess.py

1. An uninterrupted reference run of `configs/tiny.py` (S steps, a checkpoint
   every 2 steps) in WORKDIR/reference (it also fills the shared persistent
   compilation cache, so every restart below only loads executables).
2. N trials in WORKDIR/chaos, each: start scripts/train.py (it resumes from
   the newest checkpoint); wait until it has logged k new steps (k uniform in
   1..4) and a further random fraction of a step, or, in ~10% of the trials,
   a random moment of its start-up; send SIGKILL or SIGTERM (coin flip). All
   draws come from `--seed`.
3. After each kill: the next start must resume from the newest complete
   checkpoint on disk (after a SIGTERM: the one at the last logged step, which
   the preemption handler saved), and must log at least one new step.
4. A last start runs to S; its final checkpoint and the train losses logged
   for every step (including steps replayed after a SIGKILL) are compared
   bitwise with the reference.

Prints one JSON line:
  trials            kills done
  restarts_ok       restarts that resumed from the expected checkpoint and trained on
  checkpoints_lost  restarts that resumed from an older step than expected
  corrupt_restores  checkpoints found corrupt on restore (the integrity check) or
                    restarts that failed
  final_state_equal final train state == the reference's, bit for bit
  losses_equal      every logged train loss == the reference's at that step
plus sigkills, sigterms, startup_kills, kills_during_save (a temporary Orbax
directory was present at the kill), seconds.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESUMED = re.compile(r"resumed from the checkpoint at step (\d+)")
TMP_MARK = ".orbax-checkpoint-tmp"
RUN_TIMEOUT_S = 1800


def child_cmd(workdir: str, steps: int, cache: str) -> list[str]:
  return [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
          "--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", workdir,
          f"--config.train.steps={steps}", "--config.train.checkpoint_every=2",
          "--config.train.keep=3", f"--config.train.eval_every={steps}",
          "--config.train.eval_batches=1", "--config.train.log_every=1",
          f"--config.train.compile_cache={cache}"]


def child_env() -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS="--xla_force_host_platform_device_count=8")


def logged_steps(workdir: str) -> list[tuple[int, float]]:
  """(step, train_loss) of every train row in metrics.jsonl (a torn last line is skipped)."""
  return metric_rows(workdir, "train_loss")


def metric_rows(workdir: str, field: str) -> list[tuple[int, float]]:
  """(step, row[field]) of every metrics.jsonl row that has `field` (torn lines skipped)."""
  out = []
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:
          continue
        if field in row:
          out.append((row["step"], row[field]))
  except FileNotFoundError:
    pass
  return out


def complete_steps(ckpt_dir: str) -> list[int]:
  try:
    return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())
  except FileNotFoundError:
    return []


def tmp_dirs(ckpt_dir: str) -> set[str]:
  """Orbax temporary (unfinished) checkpoint directories."""
  try:
    return {n for n in os.listdir(ckpt_dir) if TMP_MARK in n}
  except FileNotFoundError:
    return set()


def has_tmp(ckpt_dir: str) -> bool:
  return bool(tmp_dirs(ckpt_dir))


def run_to_end(workdir: str, steps: int, cache: str) -> subprocess.CompletedProcess:
  return subprocess.run(child_cmd(workdir, steps, cache), capture_output=True, text=True,
                        env=child_env(), cwd=ROOT, timeout=RUN_TIMEOUT_S)


def trial(rng: random.Random, workdir: str, steps: int, cache: str, step_s: float) -> dict:
  """One start of the trainer, killed at a random moment; what happened."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  expected = max(complete_steps(ckpt_dir), default=None)
  n_rows = len(logged_steps(workdir))
  old_tmp = tmp_dirs(ckpt_dir)  # left by earlier kills (the next manager removes them)
  sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
  at_startup = rng.random() < 0.1
  k, frac, startup_delay = rng.randint(1, 4), rng.random(), rng.uniform(0.0, 8.0)
  err = tempfile.TemporaryFile(mode="w+")
  proc = subprocess.Popen(child_cmd(workdir, steps, cache), stdout=subprocess.DEVNULL,
                          stderr=err, env=child_env(), cwd=ROOT)
  t0 = time.monotonic()
  progressed = False
  while proc.poll() is None:
    rows = logged_steps(workdir)[n_rows:]
    progressed = progressed or bool(rows)
    if at_startup and time.monotonic() - t0 >= startup_delay:
      break
    if len(rows) >= k:
      time.sleep(frac * step_s)
      break
    time.sleep(0.005)
  during_save = bool(tmp_dirs(ckpt_dir) - old_tmp)
  if proc.poll() is None:
    proc.send_signal(sig)
  rc = proc.wait(timeout=600)
  err.seek(0)
  log = err.read()
  err.close()
  rows = logged_steps(workdir)[n_rows:]
  m = RESUMED.search(log)
  return {"expected": expected, "newest_after": max(complete_steps(ckpt_dir), default=None),
          "resumed": int(m.group(1)) if m else None,
          "progressed": progressed or bool(rows), "last_step": rows[-1][0] if rows else None,
          "signal": sig, "at_startup": at_startup and not rows, "rc": rc,
          "during_save": during_save, "corrupt": log.count("corrupt checkpoint"),
          "finished": rc == 0 and bool(rows) and rows[-1][0] == steps, "log": log}


def final_states_equal(a_dir: str, b_dir: str, step: int) -> bool:
  """Bitwise equality of the `state` item of checkpoint `step` of two runs."""
  return state_difference(a_dir, b_dir, step)[0]


def state_difference(a_dir: str, b_dir: str, step: int) -> tuple[bool, float]:
  """(bit for bit equal, largest difference of a float leaf) of the `state` item of
  checkpoint `step` of two runs: max |a - b| / max(1, max |a|) per leaf (absolute for
  values up to 1, relative for larger ones such as eval sums); inf if the trees or a
  non-float leaf differ."""
  os.environ.update(child_env())  # 8 CPU devices, as the runs that wrote them
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  def load(d):
    with ocp.StandardCheckpointer() as ckptr:
      return ckptr.restore(os.path.join(d, "checkpoints", str(step), "state"))

  return tree_difference(load(a_dir), load(b_dir))


def tree_difference(a, b) -> tuple[bool, float]:
  """(bit for bit equal, largest float-leaf difference max |a - b| / max(1, max |a|)) of two
  pytrees; inf if the structures, a dtype or shape, or a non-float leaf differ."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  (la, ta), (lb, tb) = jax.tree.flatten(a), jax.tree.flatten(b)
  if ta != tb:
    return False, float("inf")
  equal, diff = True, 0.0
  for x, y in zip(la, lb):
    x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
    if x.dtype != y.dtype or x.shape != y.shape:
      return False, float("inf")
    equal = equal and np.array_equal(x, y)
    if np.issubdtype(x.dtype, np.floating) and x.size:
      x64, y64 = x.astype(np.float64), y.astype(np.float64)
      diff = max(diff, float(np.max(np.abs(x64 - y64)) / max(1.0, np.max(np.abs(x64)))))
    elif not np.array_equal(x, y):
      return False, float("inf")
  return equal, diff


def run_dirs(workdir: str, prefix: str) -> tuple[str, str, str, str]:
  """(root, compile cache, reference run, chaos run) under `workdir` (default: a new
  temporary directory); both runs start empty, the cache is kept."""
  root = workdir or tempfile.mkdtemp(prefix=prefix)
  os.makedirs(root, exist_ok=True)
  cache, ref_dir, run_dir = (os.path.join(root, n) for n in ("xla_cache", "reference", "chaos"))
  for d in (ref_dir, run_dir):
    shutil.rmtree(d, ignore_errors=True)
  return root, cache, ref_dir, run_dir


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--trials", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--steps", type=int, default=0, help="run length (default 5 x trials + 10)")
  p.add_argument("--workdir", default="", help="default: a temporary directory (removed)")
  p.add_argument("--keep", action="store_true", help="keep the workdir")
  p.add_argument("--processes", type=int, default=1,
                 help="> 1: the multi-process chaos test (scripts/chaos_multiprocess.py)")
  p.add_argument("--samples-out", default="", help="multi-process: write every trial (JSON)")
  args = p.parse_args(argv)
  if args.processes > 1:
    import chaos_multiprocess  # pylint: disable=import-outside-toplevel
    return chaos_multiprocess.main(args)
  steps = args.steps or 5 * args.trials + 10
  rng = random.Random(args.seed)
  root, cache, ref_dir, run_dir = run_dirs(args.workdir, "gem_jax_chaos_")
  t0 = time.monotonic()
  ref = run_to_end(ref_dir, steps, cache)
  if ref.returncode != 0:
    raise SystemExit(f"reference run failed:\n{ref.stderr[-3000:]}")
  step_s = max(json.loads(ref.stdout.strip().splitlines()[-1]).get("step_time_s", 0.1), 0.01)

  results, restarts_ok, lost, corrupt = [], 0, 0, 0
  for i in range(args.trials):
    r = trial(rng, run_dir, steps, cache, step_s)
    if i > 0:  # this start is the restart after the previous kill
      ok, was_lost = _judge(results[-1], r)
      restarts_ok += ok
      lost += was_lost
    corrupt += r["corrupt"] + (r["rc"] not in (0, -signal.SIGKILL, -signal.SIGTERM))
    results.append(r)
    when = "during start-up" if r["at_startup"] else f"after step {r['last_step']}"
    print(f"trial {i + 1}/{args.trials}: {signal.Signals(r['signal']).name} {when}"
          f"{' (save in flight)' if r['during_save'] else ''}, resumed from {r['resumed']}, "
          f"rc {r['rc']}", file=sys.stderr, flush=True)
    if r["rc"] not in (0, -signal.SIGKILL, -signal.SIGTERM):
      print(r["log"][-3000:], file=sys.stderr)
  expected = max(complete_steps(os.path.join(run_dir, "checkpoints")), default=None)
  last = run_to_end(run_dir, steps, cache)
  m = RESUMED.search(last.stderr)
  final = {"expected": expected, "resumed": int(m.group(1)) if m else None,
           "progressed": last.returncode == 0, "rc": last.returncode, "signal": None,
           "last_step": steps, "corrupt": last.stderr.count("corrupt checkpoint")}
  if results:
    ok, was_lost = _judge(results[-1], final)
    restarts_ok += ok
    lost += was_lost
  corrupt += final["corrupt"] + (last.returncode != 0)
  if last.returncode != 0:
    print(last.stderr[-3000:], file=sys.stderr)

  ref_losses = dict(logged_steps(ref_dir))
  run_losses = logged_steps(run_dir)
  out = {
      "trials": args.trials, "restarts_ok": restarts_ok, "checkpoints_lost": lost,
      "corrupt_restores": corrupt,
      "final_state_equal": last.returncode == 0 and final_states_equal(ref_dir, run_dir, steps),
      "losses_equal": bool(run_losses) and all(ref_losses.get(s) == v for s, v in run_losses),
      "steps": steps, "sigkills": sum(r["signal"] == signal.SIGKILL for r in results),
      "sigterms": sum(r["signal"] == signal.SIGTERM for r in results),
      "startup_kills": sum(r["at_startup"] for r in results),
      "kills_during_save": sum(r["during_save"] for r in results),
      "seconds": round(time.monotonic() - t0, 1),
  }
  print(json.dumps(out), flush=True)
  if not (args.keep or args.workdir):
    shutil.rmtree(root, ignore_errors=True)
  return out


def _judge(killed: dict, restart: dict) -> tuple[bool, bool]:
  """(restart ok, checkpoint lost) for the start that followed `killed`.

  Lost: the restart resumed from an older step than the newest complete
  checkpoint on disk when it started, or a SIGTERM that ended the run cleanly
  left no checkpoint at its last logged step.
  """
  if restart.get("at_startup"):
    # Killed during start-up (by design, ~10% of trials): it had no chance to
    # train; it must not have resumed from a wrong checkpoint if it got that far,
    # and the start after it is judged against the same newest checkpoint.
    lost = restart["resumed"] is not None and restart["resumed"] != restart["expected"]
    return not lost, bool(lost)
  lost = restart["expected"] is not None and restart["resumed"] != restart["expected"]
  if killed["signal"] == signal.SIGTERM and killed["rc"] == 0 and killed["last_step"]:
    lost = lost or killed["newest_after"] != killed["last_step"]
  ok = (not lost and restart["progressed"]
        and restart["rc"] in (0, -signal.SIGKILL, -signal.SIGTERM))
  return ok, bool(lost)


if __name__ == "__main__":
  main()
