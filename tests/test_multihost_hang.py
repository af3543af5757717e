"""A hung process (SIGSTOP, not a death) in a real 2 x 4 run on loopback.

The launcher starts 2 processes x 4 CPU devices on `tiny`; once checkpoints exist,
one process is stopped with SIGSTOP. Its heartbeats stop too, but the heartbeat
timeout is set far above the step timeout, so what ends the run is the step
watchdog of the other process: exit status 75 within the step timeout (plus its
polling and the peer lookup), with a message naming the step and the stalled
process. A relaunch resumes from the last complete checkpoint. Stopping process 0
(the one that hosts the coordination service) is covered too: the peer lookup
then gets no answer, and the survivor says so and still exits 75 in bounded time.

Slow: each launch compiles tiny in both processes (2-3 min on 2 shared cores).
"""
import os
import re
import signal
import time

import pytest

import test_multihost_runs as mh

pytestmark = pytest.mark.slow

STEP_TIMEOUT_S = 20
HANG_ENV = {"GEM_JAX_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S), "GEM_JAX_HEARTBEAT_TIMEOUT_S": "90",
            "GEM_JAX_KILL_AFTER_S": "3", "GEM_JAX_TERM_GRACE_S": "1"}
LONG_RUN = ("--config.train.steps=400", "--config.train.eval_every=1000",
            "--config.train.checkpoint_every=2", "--config.train.keep=50")


def start_2x4(workdir, cache, tag, *overrides, **env):
  """Starts the launcher (2 x 4) without waiting; returns (launcher, [pid of process i])."""
  os.makedirs(workdir, exist_ok=True)
  log = os.path.join(workdir, f"launch_{tag}.log")
  proc = mh._spawn(["bash", mh.LAUNCH, "2", "4", "--",  # pylint: disable=protected-access
                    *mh._train_args(workdir, cache, *overrides)],  # pylint: disable=protected-access
                   mh._env(4, GEM_JAX_LOG_DIR=os.path.join(workdir, f"logs_{tag}"), **env),  # pylint: disable=protected-access
                   log)
  deadline = time.monotonic() + 60
  while True:
    with open(log) as f:
      found = dict(re.findall(r"launch_local: process (\d+): pid (\d+)", f.read()))
    if len(found) == 2:
      return proc, [int(found["0"]), int(found["1"])]
    assert time.monotonic() < deadline and proc.poll() is None, "launcher did not start"
    time.sleep(0.1)


def gone(pid: int) -> bool:
  """Whether `pid` has exited (absent, or a zombie not yet reaped by the launcher)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except FileNotFoundError:
    return True


def wait_for_checkpoint(workdir, at_least, launcher, log_dir, timeout=mh.RUN_TIMEOUT_S):
  deadline = time.monotonic() + timeout
  while not [s for s in mh._complete_steps(os.path.join(workdir, "checkpoints"))  # pylint: disable=protected-access
             if s >= at_least]:
    assert launcher.poll() is None, open(os.path.join(log_dir, "process_0.log")).read()[-3000:]
    assert time.monotonic() < deadline, "no checkpoint appeared"
    time.sleep(0.2)


def _kill_group(proc):
  if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGKILL)
  proc.communicate()


@pytest.mark.parametrize("stopped", [1, 0])
def test_sigstopped_process_stops_its_peer_with_a_watchdog_report(tmp_path, stopped):
  cache, work = tmp_path / "xla_cache", tmp_path / "hang"
  survivor = 1 - stopped
  launcher, pids = start_2x4(work, cache, "hang", *LONG_RUN, **HANG_ENV)
  try:
    wait_for_checkpoint(work, 4, launcher, work / "logs_hang")
    os.kill(pids[stopped], signal.SIGSTOP)
    t_stop = time.monotonic()
    while not gone(pids[survivor]):
      assert time.monotonic() - t_stop < 180, "the survivor did not stop"
      time.sleep(0.05)
    took = time.monotonic() - t_stop
    rc = launcher.wait(timeout=120)   # the launcher kills the stopped process after 3 s
  finally:
    for p in pids:
      try:
        os.kill(p, signal.SIGKILL)
      except ProcessLookupError:
        pass
    _kill_group(launcher)
  log = (work / "logs_hang" / f"process_{survivor}.log").read_text()
  print(f"SIGSTOP process {stopped}: process {survivor} exited with {rc} {took:.1f} s later")
  assert rc == 75, log[-3000:]
  assert took < STEP_TIMEOUT_S + 15
  m = re.search(rf"\[process {survivor}/2\] step watchdog: no progress for (\d+) s after step "
                r"(\d+) \(stalled in step (\d+); timeout 20 s\); (.*); exiting with status 75",
                log)
  assert m, log[-3000:]
  step = int(m.group(2))
  assert int(m.group(3)) == step + 1 and step >= 4
  if stopped == 1:  # the survivor hosts the coordination service: it names the stalled peer
    peer = re.fullmatch(r"stalled: process 1 \(silent for (\d+) s, last reported step "
                        r"(\d+)\); alive: none", m.group(4))
    assert peer and int(peer.group(1)) >= STEP_TIMEOUT_S - 5, m.group(4)
    assert step - 4 <= int(peer.group(2)) <= step + 1  # published every timeout / 5 = 4 s
  else:             # process 0 hosts it: no answer, which points at process 0
    assert m.group(4).startswith("peer states unknown (the coordination service did not "
                                 "answer within 5 s; it runs in process 0"), m.group(4)
    return
  # Relaunch, as an orchestrator would: resumes from the last complete checkpoint.
  last = mh._complete_steps(work / "checkpoints")[-1]  # pylint: disable=protected-access
  out = mh.run_2x4(work, cache, *LONG_RUN, f"--config.train.stop_at={last + 2}")
  assert out["step"] == last + 2
  assert f"resumed from the checkpoint at step {last}" in (work / "logs" / "process_0.log"
                                                           ).read_text()
