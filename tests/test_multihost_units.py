"""Multi-host building blocks, in one process: settings from flags/env, data
positions in checkpoints, per-process id preparation, the step watchdog and its
peer report, preemption through JAX's sync point."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

from gem_jax import embedding as emb_lib
from gem_jax.parallel import distributed as dist
from gem_jax.train import preemption
from gem_jax.train import watchdog as wd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ settings --

def test_explicit_settings_from_env():
  s = dist.settings_from_flags_and_env({
      "GEM_JAX_COORDINATOR": "10.0.0.1:1234", "GEM_JAX_NUM_PROCESSES": "4",
      "GEM_JAX_PROCESS_ID": "3", "GEM_JAX_HEARTBEAT_TIMEOUT_S": "7",
      "GEM_JAX_INIT_TIMEOUT_S": "11"})
  assert (s.mode, s.coordinator, s.num_processes, s.process_id) == ("explicit", "10.0.0.1:1234",
                                                                     4, 3)
  assert (s.timeouts.heartbeat_s, s.timeouts.initialization_s, s.timeouts.shutdown_s) == (7, 11,
                                                                                          300)


def test_auto_and_named_detection_and_single_process():
  assert dist.settings_from_flags_and_env({"GEM_JAX_DISTRIBUTED": "auto"}).mode == "auto"
  assert dist.settings_from_flags_and_env({"GEM_JAX_DISTRIBUTED": "slurm"}).mode == "slurm"
  single = dist.settings_from_flags_and_env({})
  assert single.mode == "none" and single.timeouts == dist.Timeouts()
  assert dist.initialize(single) is False  # a single-process run touches nothing


@pytest.mark.parametrize("env, match", [
    ({"GEM_JAX_COORDINATOR": "h:1", "GEM_JAX_NUM_PROCESSES": "2"}, "process_id"),
    ({"GEM_JAX_COORDINATOR": "h:1", "GEM_JAX_NUM_PROCESSES": "2", "GEM_JAX_PROCESS_ID": "2"},
     r"not in \[0, 2\)"),
])
def test_incomplete_explicit_settings_are_errors(env, match):
  with pytest.raises(ValueError, match=match):
    dist.settings_from_flags_and_env(env)


# ------------------------------------------------------------- data positions --

def test_data_positions_single_process_and_own_position():
  pos = {"batch": 5, "seed": 0}
  saved = dist.data_positions(pos)
  assert saved == {"position": pos, "by_process": [pos]}
  assert dist.own_data_position(saved) == pos
  # Saved by 2 processes, restored by 1: the global position (process 0's).
  two = {"position": {"batch": 5, "bad": 0}, "by_process": [{"batch": 5, "bad": 0},
                                                            {"batch": 5, "bad": 2}]}
  assert dist.own_data_position(two) == {"batch": 5, "bad": 0}
  assert dist.own_data_position({"batch": 3}) == {"batch": 3}  # pre-multi-host checkpoints
  assert dist.own_data_position(None) is None


def test_prepare_ids_of_a_process_slice_matches_the_global_batch(mesh8):
  tables = [emb_lib.TableConfig("t", rows=10, dim=4, id_policy="hash")]
  feats = [emb_lib.FeatureConfig("f", "t", bag=2)]
  plan = emb_lib.plan_embeddings(tables, feats, mesh8, batch_size=8,
                                 optimizer=emb_lib.SparseOptimizerConfig())
  ids = {"f": np.array([[1, 25], [-1, 3], [9, 10], [123456789, 0]] * 2)}
  whole = emb_lib.prepare_ids(plan, ids)["f"]
  for p in range(2):  # each of 2 processes prepares its 4 rows
    part = emb_lib.prepare_ids(plan, {"f": ids["f"][4 * p:4 * p + 4]}, process_index=p,
                               process_count=2)["f"]
    np.testing.assert_array_equal(part, whole[4 * p:4 * p + 4])
  assert whole[1, 0] == -1
  with pytest.raises(ValueError, match=r"expected \(4, 2\) \(process 1's 4 of 8 rows"):
    emb_lib.prepare_ids(plan, ids, process_index=1, process_count=2)
  with pytest.raises(ValueError, match=r"expected \(8, 2\)"):
    emb_lib.prepare_ids(plan, {"f": ids["f"][:4]})
  with pytest.raises(ValueError, match="process_index 2"):
    emb_lib.prepare_ids(plan, ids, process_index=2, process_count=2)


# ------------------------------------------------------------------ watchdog --

def test_watchdog_fires_when_beats_stop_and_not_while_beating():
  messages = []
  dog = wd.StepWatchdog(0.5, step=7, process_index=1, process_count=2,
                        on_stall=messages.append, poll_s=0.05)
  for s in range(8, 12):  # beats every 0.1 s: no stall
    time.sleep(0.1)
    dog.beat(s)
  assert not messages
  time.sleep(1.0)
  dog.stop()
  assert len(messages) == 1 and dog.fired
  assert "[process 1/2]" in messages[0] and "after step 11" in messages[0]
  assert "stalled in step 12" in messages[0]


def test_watchdog_off_by_default_in_one_process():
  assert wd.resolve_timeout_s({}) == 0.0
  assert wd.resolve_timeout_s({"GEM_JAX_STEP_TIMEOUT_S": "12.5"}) == 12.5
  dog = wd.StepWatchdog.from_env(env={})
  assert not dog.enabled
  dog.stop()


def test_stalled_process_exits_nonzero_with_its_step():
  code = textwrap.dedent("""
      import time
      from gem_jax.train.watchdog import StepWatchdog
      dog = StepWatchdog(1.0, step=3, process_index=0, process_count=1)
      dog.beat(4)
      time.sleep(30)
      """)
  t0 = time.monotonic()
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=60, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == wd.STALL_EXIT_CODE
  assert time.monotonic() - t0 < 25
  assert "step watchdog: no progress" in proc.stderr and "after step 4" in proc.stderr
  assert "StepWatchdog" in proc.stderr or "Thread" in proc.stderr  # the stacks are dumped


class FakeClock:
  def __init__(self, t=1000.0):
    self.t = t

  def __call__(self):
    return self.t


def _board(store, index, count, clock):
  return wd.PeerBoard(store.__setitem__,
                      lambda prefix: [(k, v) for k, v in store.items() if k.startswith(prefix)],
                      index, count, clock)


def test_peer_board_names_the_silent_peer():
  store, clock = {}, FakeClock()
  boards = [_board(store, i, 3, clock) for i in range(3)]
  boards[1].publish(7)                       # then process 1 stops (SIGSTOP)
  clock.t += 12
  boards[0].publish(7)
  boards[2].publish(7)
  assert boards[0].read() == {0: {"step": 7, "time": 1012.0}, 1: {"step": 7, "time": 1000.0},
                              2: {"step": 7, "time": 1012.0}}
  text = boards[0].describe(stale_s=6, wait_s=1)
  assert text == ("stalled: process 1 (silent for 12 s, last reported step 7); "
                  "alive: process 2 (last reported step 7)")
  assert _board({}, 0, 2, clock).describe(6, 1) == ("stalled: process 1 (never reported); "
                                                     "alive: none")


def test_peer_board_gives_up_on_a_store_that_does_not_answer():
  hang = threading.Event()
  board = wd.PeerBoard(lambda k, v: None, lambda prefix: hang.wait(30) and [], 1, 2)
  t0 = time.monotonic()
  text = board.describe(stale_s=6, wait_s=0.3)
  hang.set()
  assert time.monotonic() - t0 < 5
  assert "peer states unknown" in text and "did not answer within 0.3 s" in text
  failing = wd.PeerBoard(lambda k, v: None, lambda prefix: 1 / 0, 1, 2)
  assert "failed: division by zero" in failing.describe(6, 1)


def test_watchdog_message_names_the_stalled_peer():
  store, messages = {}, []
  peer = _board(store, 1, 2, time.time)
  peer.publish(4)                            # the peer's last sign of life
  dog = wd.StepWatchdog(0.6, step=4, process_index=0, process_count=2,
                        on_stall=messages.append, poll_s=0.05,
                        board=_board(store, 0, 2, time.time), publish_s=0.1)
  time.sleep(1.5)
  dog.stop()
  assert len(messages) == 1
  assert "[process 0/2] step watchdog: no progress" in messages[0]
  assert "after step 4 (stalled in step 5" in messages[0]
  assert re.search(r"stalled: process 1 \(silent for \d+ s, last reported step 4\); "
                   r"alive: none; exiting with status 75$", messages[0]), messages[0]
  assert '"step": 4' in store[wd.PEER_KEY_PREFIX + "0"]  # this process published too


def test_watchdog_without_jax_distributed_has_no_board():
  assert wd.PeerBoard.from_jax() is None
  dog = wd.StepWatchdog.from_env(env={"GEM_JAX_STEP_TIMEOUT_S": "30"})
  assert dog.enabled and dog.board is None
  dog.stop()


# ---------------------------------------------------------------- preemption --

def test_preemption_uses_jax_sync_point_and_leaves_sigterm_to_jax(monkeypatch):
  """Under jax.distributed: SIGTERM stays with JAX's notifier, SIGINT-like signals are
  forwarded to it, and the stop is JAX's sync point (at a global step)."""
  from jax.experimental import multihost_utils
  assert not preemption.jax_preemption_service()  # this test process: no jax.distributed
  seen, counters = [], []
  notifier = lambda signum, frame: seen.append(signum)  # noqa: E731  (stands in for JAX's)
  previous = signal.signal(signal.SIGTERM, notifier)
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                      lambda n: counters.append(n) or n == 43)
  try:
    w = preemption.PreemptionWatcher(signals=(signal.SIGTERM, signal.SIGUSR1),
                                     use_jax_service=True)
    with w:
      assert signal.getsignal(signal.SIGTERM) is notifier   # not replaced
      os.kill(os.getpid(), signal.SIGUSR1)
      assert seen == [signal.SIGTERM] and w.received == signal.SIGUSR1
      assert [w.should_stop(s) for s in (41, 42, 43)] == [False, False, True]
    assert counters == [41, 42, 43] and w.stopped_at == 43  # global steps, as Orbax
    assert signal.getsignal(signal.SIGTERM) is notifier
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_notice_from_before_the_loop_stops_every_process_after_the_first_step(monkeypatch):
  """A notice posted before the loop (its sync point possibly past): decided at the
  first check, by an all-gather, so every process stops at the same step."""
  from jax.experimental import multihost_utils
  gathered = []
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda n: False)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: gathered.append(int(x)) or np.array([int(x), 1]))
  w = preemption.PreemptionWatcher(use_jax_service=True)   # this process saw no notice
  assert w.should_stop(101) is True and w.stopped_at == 101
  assert gathered == [0]
  later = preemption.PreemptionWatcher(use_jax_service=True)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: gathered.append(int(x)) or np.array([0, 0]))
  assert [later.should_stop(s) for s in (5, 6, 7)] == [False, False, False]
  assert gathered == [0, 0]                                  # only at the first check


# ------------------------------------------------------------------ launcher --

FAKE_TRAIN = """
import os, sys, time
pid = int(os.environ["GEM_JAX_PROCESS_ID"])
line = " ".join(str(v) for v in (os.environ["GEM_JAX_COORDINATOR"],
                                  os.environ["GEM_JAX_NUM_PROCESSES"], pid,
                                  os.environ["XLA_FLAGS"], sys.argv[1:]))
os.write(1, (line + "\\n").encode())  # one write: the processes share stdout
if pid == 0:
  time.sleep(float(os.environ.get("HANG_S", "0")))   # a peer that never stops by itself
sys.exit(3 if pid == 1 else 0)
"""


def _launch(tmp_path, n, d, *args, **env):
  script = tmp_path / "fake_train.py"
  script.write_text(FAKE_TRAIN)
  return subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), str(n), str(d), "--", *args],
      env=dict(os.environ, PYTHON=sys.executable, GEM_JAX_SCRIPT=str(script), **env),
      capture_output=True, text=True, timeout=120)


def test_launcher_sets_each_process_up_and_returns_the_failure(tmp_path):
  proc = _launch(tmp_path, 3, 2, "--config", "c.py", GEM_JAX_PORT="12345")
  assert proc.returncode == 3
  assert sorted(proc.stdout.splitlines()) == [
      f"127.0.0.1:12345 3 {i} --xla_force_host_platform_device_count=2 ['--config', 'c.py']"
      for i in range(3)]
  assert [ln.split(": pid ")[0] for ln in proc.stderr.splitlines() if ": pid " in ln] == [
      f"launch_local: process {i}" for i in range(3)]


def test_launcher_kills_a_hung_peer_after_a_failure(tmp_path):
  t0 = time.monotonic()
  proc = _launch(tmp_path, 2, 1, HANG_S="100", GEM_JAX_KILL_AFTER_S="1",
                 GEM_JAX_TERM_GRACE_S="1")
  assert proc.returncode == 3
  assert time.monotonic() - t0 < 30
  assert "killing processes still running" in proc.stderr
