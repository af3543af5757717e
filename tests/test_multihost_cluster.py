"""Cluster detection: a SLURM launch reaches `jax.distributed.initialize` in the
auto-detecting form, and JAX's own SlurmCluster reads the variables srun sets.

The first tests record the arguments (JAX's initialize is replaced); the last one
starts two real processes with the variables srun would give two tasks on one node
and lets JAX's detection connect them over loopback.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import pytest
from absl import logging
from jax._src import clusters

from gem_jax.parallel import distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What `srun --ntasks=4 --nodes=2` gives task 2 (the first task on its second node).
SLURM_TASK_2_OF_4 = {
    "SLURM_JOB_ID": "123456", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
    "SLURM_STEP_NODELIST": "node[017-018]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NODELIST": "node[017-018]", "SLURM_JOB_NODELIST": "node[017-018]"}
# JAX's SLURM port: 65535 - 2^12 + 1 + job id mod 2^12.
SLURM_PORT = 61440 + 123456 % 4096
OTHER_LAUNCHERS = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS",
                   "JAX_COORDINATOR_PORT", "JAX_LOCAL_DEVICE_IDS", "KUBERNETES_SERVICE_HOST",
                   "GEM_JAX_COORDINATOR", "GEM_JAX_NUM_PROCESSES", "GEM_JAX_PROCESS_ID")


@pytest.fixture
def slurm_env(monkeypatch):
  for k in OTHER_LAUNCHERS + ("GEM_JAX_DISTRIBUTED",):
    monkeypatch.delenv(k, raising=False)
  for k, v in SLURM_TASK_2_OF_4.items():
    monkeypatch.setenv(k, v)
  return monkeypatch


@pytest.fixture
def recorded_initialize(monkeypatch):
  """Replaces jax.distributed.initialize (and the config switch it needs) by recorders."""
  calls = {"initialize": [], "config": []}
  monkeypatch.setattr(jax.distributed, "initialize",
                      lambda *a, **kw: calls["initialize"].append((a, kw)))
  monkeypatch.setattr(jax.config, "update", lambda k, v: calls["config"].append((k, v)))
  yield calls
  handler = logging.get_absl_handler()
  for f in [f for f in handler.filters if isinstance(f, dist._ProcessTag)]:  # pylint: disable=protected-access
    handler.removeFilter(f)


def test_jax_slurm_detection_reads_the_srun_variables(slurm_env):
  del slurm_env
  assert clusters.SlurmCluster.is_env_present()
  assert not clusters.OmpiCluster.is_env_present()  # Open MPI is tried first by JAX
  assert clusters.SlurmCluster.get_coordinator_address(None, None) == f"node017:{SLURM_PORT}"
  assert clusters.SlurmCluster.get_process_count() == 4
  assert clusters.SlurmCluster.get_process_id() == 2
  assert dist.launcher_tasks() == ("slurm", 4)


@pytest.mark.parametrize("mode, method", [("auto", None), ("slurm", "slurm")])
def test_auto_mode_calls_initialize_the_detecting_way(slurm_env, recorded_initialize, mode,
                                                       method):
  slurm_env.setenv("GEM_JAX_DISTRIBUTED", mode)
  assert dist.maybe_initialize() is True
  [(args, kw)] = recorded_initialize["initialize"]
  assert args == ()                                         # no coordinator address
  assert kw["num_processes"] is None and kw["process_id"] is None
  assert kw.get("cluster_detection_method") == method
  assert "coordinator_address" not in kw and "local_device_ids" not in kw
  assert (kw["heartbeat_timeout_seconds"], kw["initialization_timeout"],
          kw["shutdown_timeout_seconds"]) == (100, 300, 300)
  assert ("jax_cpu_collectives_implementation", "gloo") in recorded_initialize["config"]
  # What JAX's initialize does with exactly these arguments: SLURM fills every gap.
  got = clusters.ClusterEnv.auto_detect_unset_distributed_params(
      None, kw["num_processes"], kw["process_id"], None, kw.get("cluster_detection_method"),
      kw["initialization_timeout"])
  assert got == (f"node017:{SLURM_PORT}", 4, 2, [0])  # [0]: one device per task (SLURM_LOCALID)


def test_a_multi_task_launch_without_a_setup_is_an_error(slurm_env, recorded_initialize):
  with pytest.raises(ValueError, match=r"started by slurm as one of 4 tasks.*distributed=auto"):
    dist.maybe_initialize()
  slurm_env.setenv("GEM_JAX_DISTRIBUTED", "none")         # independent runs, asked for
  assert dist.maybe_initialize() is False
  slurm_env.delenv("GEM_JAX_DISTRIBUTED")
  slurm_env.setenv("SLURM_NTASKS", "1")                    # a one-task step: single process
  assert dist.maybe_initialize() is False
  assert not recorded_initialize["initialize"]


def test_open_mpi_launch_is_recognised():
  env = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911",
         "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3"}
  assert dist.launcher_tasks(env) == ("ompi", 8)
  with pytest.raises(ValueError, match="started by ompi as one of 8 tasks"):
    dist.settings_from_flags_and_env(env)
  assert dist.settings_from_flags_and_env(dict(env, GEM_JAX_DISTRIBUTED="auto")).mode == "auto"


PROBE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from gem_jax.parallel import distributed as dist
    assert dist.maybe_initialize()
    import jax
    print(json.dumps({{"index": jax.process_index(), "count": jax.process_count(),
                      "devices": jax.device_count(),
                      "gathered": dist.allgather_json(jax.process_index())}}), flush=True)
    """)


def _free_slurm_port() -> int:
  for port in range(61440 + os.getpid() % 4000, 65536):
    with socket.socket() as s:
      try:
        s.bind(("", port))
      except OSError:
        continue
    return port
  raise RuntimeError("no free port in JAX's SLURM range")


def test_two_srun_like_tasks_connect_through_jax_slurm_detection():
  """Two processes with only srun's variables (and --distributed=auto) form one run."""
  port = _free_slurm_port()
  job_id = 4096 * 7 + (port - 61440)                       # JAX derives `port` from it
  base = {k: v for k, v in os.environ.items() if k not in OTHER_LAUNCHERS}
  base.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
              GEM_JAX_DISTRIBUTED="auto", GEM_JAX_HEARTBEAT_TIMEOUT_S="20",
              GEM_JAX_INIT_TIMEOUT_S="120", SLURM_JOB_ID=str(job_id), SLURM_NTASKS="2",
              SLURM_STEP_NODELIST="localhost", SLURM_STEP_NUM_NODES="1")
  procs = [subprocess.Popen([sys.executable, "-c", PROBE.format(root=ROOT)],
                            env=dict(base, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=240)
      assert p.returncode == 0, err[-3000:]
      outs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.communicate()
  assert [o["index"] for o in outs] == [0, 1]
  assert all(o["count"] == 2 and o["devices"] == 4 and o["gathered"] == [0, 1] for o in outs)
