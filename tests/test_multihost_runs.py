"""Multi-process training on loopback: 2 processes x 4 CPU devices vs 1 x 8.

Each run is a real `scripts/train.py` on the `tiny` config, the 2 x 4 runs
through `scripts/launch_local.sh` (processes on 127.0.0.1, a free port each).
Both shapes use the same (2, 4) mesh and the same global batches, so the
losses and the final parameters must agree to fp32 rounding. Every child runs
in its own process group with a hard timeout (the group is killed), so a hang
can never block the suite.

All of it is marked slow: a tiny compile takes ~1.5-4 min per process shape on
2 shared CPU cores, far over the default suite's budget.
"""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
LAUNCH = os.path.join(ROOT, "scripts", "launch_local.sh")
RUN_TIMEOUT_S = 900
pytestmark = pytest.mark.slow

FAST_FAILURE = {"GEM_JAX_HEARTBEAT_TIMEOUT_S": "10", "GEM_JAX_SHUTDOWN_TIMEOUT_S": "10",
                "GEM_JAX_INIT_TIMEOUT_S": "300"}


def _env(devices: int, **extra) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **FAST_FAILURE)
  env.update(extra)
  return env


def _spawn(cmd, env, log_path) -> subprocess.Popen:
  log = open(log_path, "w")  # noqa: SIM115 - closed with the process
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT,
                          start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
  """stdout of `proc`; its whole process group is killed if it outlives `timeout`."""
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    raise
  return out


def _train_args(workdir, cache, *overrides):
  return ["--config", TINY, "--workdir", str(workdir), f"--config.train.compile_cache={cache}",
          *overrides]


def run_1x8(workdir, cache, *overrides) -> dict:
  os.makedirs(workdir, exist_ok=True)
  proc = _spawn([sys.executable, os.path.join(ROOT, "scripts", "train.py"),
                 *_train_args(workdir, cache, *overrides)], _env(8),
                os.path.join(workdir, "stderr_1x8.log"))
  out = _finish(proc, RUN_TIMEOUT_S)
  assert proc.returncode == 0, open(os.path.join(workdir, "stderr_1x8.log")).read()[-3000:]
  return json.loads(out.strip().splitlines()[-1])


def run_2x4(workdir, cache, *overrides) -> dict:
  os.makedirs(workdir, exist_ok=True)
  logs = os.path.join(workdir, "logs")
  proc = _spawn(["bash", LAUNCH, "2", "4", "--", *_train_args(workdir, cache, *overrides)],
                _env(4, GEM_JAX_LOG_DIR=logs), os.path.join(workdir, "stderr_launch.log"))
  out = _finish(proc, RUN_TIMEOUT_S)
  if proc.returncode != 0:
    tails = [open(os.path.join(logs, f)).read()[-2000:] for f in sorted(os.listdir(logs))]
    pytest.fail(f"2x4 run failed ({proc.returncode}):\n" + "\n----\n".join(tails))
  return json.loads(out.strip().splitlines()[-1])


def losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}


def restore_state(workdir, step):
  """The checkpoint `step` of `workdir`, restored in this (8-device) process on the tiny mesh."""
  from gem_jax.train import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  from gem_jax.train import setup  # pylint: disable=import-outside-toplevel
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("tiny_config", TINY)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  s = setup.setup(mod.get_config())
  mgr = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None, keep=9)
  try:
    restored = mgr.restore(setup.checkpoint_abstract(s.abstract, s.plan), step=step)
  finally:
    mgr.close()
  return restored


def assert_states_close(a, b) -> None:
  """Train states equal to fp32 rounding: floats within 1e-6, everything else exactly."""
  leaves_a = jax.tree_util.tree_leaves_with_path(a)
  leaves_b = jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b) > 10
  for (path, x), y in zip(leaves_a, leaves_b):
    x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
    name = jax.tree_util.keystr(path)
    if name.startswith(".metrics"):  # eval sums over 512 rows (~50): fp32 rounding of the sum
      np.testing.assert_allclose(y, x, rtol=1e-6, atol=0, err_msg=name)
    elif np.issubdtype(x.dtype, np.floating):  # parameters, optimizer state, tables
      np.testing.assert_allclose(y, x, rtol=0, atol=1e-6, err_msg=name)
    else:
      np.testing.assert_array_equal(y, x, err_msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("multihost")
  cache = tmp / "xla_cache"
  t0 = time.perf_counter()
  one = run_1x8(tmp / "1x8", cache)
  t1 = time.perf_counter()
  two = run_2x4(tmp / "2x4", cache)
  t2 = time.perf_counter()
  print(f"1x8 run {t1 - t0:.1f} s, 2x4 run {t2 - t1:.1f} s")
  return tmp, cache, one, two


def test_2x4_losses_and_params_equal_1x8(runs):
  tmp, _, one, two = runs
  a, b = losses(tmp / "1x8"), losses(tmp / "2x4")
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)],
                             rtol=0, atol=1e-6)
  assert one["step"] == two["step"] == 6
  assert two["eval_auc"] == pytest.approx(one["eval_auc"], abs=1e-5)
  ra, rb = restore_state(tmp / "1x8", 6), restore_state(tmp / "2x4", 6)
  assert_states_close(ra.state, rb.state)
  # The data position holds both processes' iterator states.
  assert len(rb.data_state["train"]["by_process"]) == 2
  assert rb.data_state["train"]["position"] == ra.data_state["train"]["position"]


def test_only_process_0_writes_and_every_process_tags_its_logs(runs):
  tmp = runs[0]
  logs = tmp / "2x4" / "logs"
  assert "[process 0/2]" in (logs / "process_0.log").read_text()
  assert "[process 1/2]" in (logs / "process_1.log").read_text()
  with open(tmp / "2x4" / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f if "train_loss" in line]
  assert steps == [1, 2, 3, 4, 5, 6]  # one writer: no line twice


@pytest.mark.parametrize("first, then", [("2x4", "1x8"), ("1x8", "2x4")])
def test_checkpoint_moves_between_2x4_and_1x8(runs, first, then):
  tmp, cache, _, _ = runs
  fns = {"1x8": run_1x8, "2x4": run_2x4}
  work = tmp / f"{first}_then_{then}"
  part = fns[first](work, cache, "--config.train.stop_at=3")
  resumed = fns[then](work, cache)
  assert part["step"] == 3 and resumed["step"] == 6
  a, b = losses(tmp / "1x8"), losses(work)
  assert sorted(b) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)],
                             rtol=0, atol=1e-6)


def _complete_steps(ckpt_dir) -> list[int]:
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


def test_killed_process_stops_its_peer_and_relaunch_resumes(tmp_path):
  cache = tmp_path / "xla_cache"
  work = tmp_path / "killed"
  os.makedirs(work / "logs_killed")
  args = _train_args(work, cache, "--config.train.steps=400", "--config.train.eval_every=1000",
                     "--config.train.checkpoint_every=2", "--config.train.keep=50")
  port = _free_port()
  procs = [_spawn([sys.executable, os.path.join(ROOT, "scripts", "train.py"), *args],
                  _env(4, GEM_JAX_COORDINATOR=f"127.0.0.1:{port}", GEM_JAX_NUM_PROCESSES="2",
                       GEM_JAX_PROCESS_ID=str(i)),
                  work / "logs_killed" / f"process_{i}.log") for i in range(2)]
  try:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not [s for s in _complete_steps(work / "checkpoints") if s >= 4]:
      assert time.monotonic() < deadline, "no checkpoint appeared"
      assert all(p.poll() is None for p in procs), (work / "logs_killed" / "process_0.log"
                                                    ).read_text()[-3000:]
      time.sleep(0.2)
    os.killpg(procs[1].pid, signal.SIGKILL)
    t_kill = time.monotonic()
    procs[0].wait(timeout=90)
    took = time.monotonic() - t_kill
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.communicate()
  print(f"survivor exited with {procs[0].returncode} {took:.1f} s after the kill")
  assert procs[0].returncode != 0
  assert took < 60
  last = _complete_steps(work / "checkpoints")[-1]
  # Relaunch (the launcher, as an orchestrator would): resumes from `last`.
  out = run_2x4(work, cache, "--config.train.steps=400", "--config.train.eval_every=1000",
                "--config.train.checkpoint_every=2", "--config.train.keep=50",
                f"--config.train.stop_at={last + 2}")
  assert out["step"] == last + 2
  assert f"resumed from the checkpoint at step {last}" in (work / "logs" / "process_0.log"
                                                           ).read_text()


def _free_port() -> int:
  import socket  # pylint: disable=import-outside-toplevel
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
