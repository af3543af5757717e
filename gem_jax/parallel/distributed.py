"""Multi-process start-up and cross-process helpers: call `maybe_initialize()` first.

On a cluster every process (one per host, or one per GPU) runs the same command
and JAX's multi-controller runtime (`jax.distributed`) connects them: a
coordinator (process 0's host:port) hands out the topology, collectives run over
NCCL on GPUs and gloo on CPU. How a process learns its place, first match wins:

  1. flags `--coordinator_address=host:port --num_processes=N --process_id=i`
     (or env GEM_JAX_COORDINATOR, GEM_JAX_NUM_PROCESSES, GEM_JAX_PROCESS_ID; the
     local launcher `scripts/launch_local.sh` and the tests use these);
  2. `--distributed=auto` (env GEM_JAX_DISTRIBUTED=auto): JAX detects the cluster
     (SLURM, Open MPI, Cloud TPU, ...); `--distributed=slurm|mpi4py|...` names
     the detection method. Under SLURM and Open MPI, JAX also pins each process
     to the one local device numbered by its local rank (one process per GPU);
     for one process per node set JAX_LOCAL_DEVICE_IDS=0,1,...,7 or use (1);
  3. nothing: a single-process run; `jax.distributed` is not touched. If the
     environment shows a SLURM step or an `mpirun` job of several tasks, that
     is an error (every task would train alone on the same workdir); pass
     `--distributed=none` to run them as independent single-process runs.

Failure detection (`Timeouts`): every process sends heartbeats to the
coordinator; one that misses them for `heartbeat_timeout_s` is declared dead and
the runtime terminates the others with a non-zero status. Start-up waits at most
`initialization_timeout_s` for all processes to connect. Defaults are for
clusters (minutes); tests set seconds (env GEM_JAX_HEARTBEAT_TIMEOUT_S, ...).
A hung (not dead) peer is caught by the step watchdog (`gem_jax/train/watchdog.py`).

Logging: once initialised, every log line carries `[process i/N]`, so each
process's warnings can be told apart in a merged log; metrics are reduced
inside the jitted step (global arrays) and written by process 0 only.
"""
from __future__ import annotations

import dataclasses
import json
import logging as pylogging
import os
from typing import Any, Mapping

import jax
import numpy as np
from absl import flags
from absl import logging

_COORD = flags.DEFINE_string("coordinator_address", None,
                             "host:port of process 0's coordinator (multi-process runs)")
_NPROC = flags.DEFINE_integer("num_processes", None, "number of processes of the run")
_PID = flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)")
_MODE = flags.DEFINE_string(
    "distributed", None, "'auto' (JAX detects SLURM / Open MPI / Cloud TPU), a detection "
    "method name ('slurm', 'mpi4py', ...), or 'none'")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", None, "a process silent this long is declared dead and the run "
    "stops with a non-zero status (default 100)")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout_s", None, "how long start-up waits for every process (default 300)")


@dataclasses.dataclass(frozen=True)
class Timeouts:
  """Bounds on waiting for other processes (seconds).

  Attributes:
    heartbeat_s: a process that sent no heartbeat for this long is dead; the
      others are stopped (non-zero exit) by the runtime.
    initialization_s: start-up gives up if not every process connected by then.
    shutdown_s: how long a finishing process waits for the others at exit.
  """
  heartbeat_s: int = 100
  initialization_s: int = 300
  shutdown_s: int = 300


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
  """How to start `jax.distributed` (None fields: let JAX decide / not used).

  Attributes:
    mode: 'explicit' (coordinator, num_processes, process_id given), 'auto' or a
      cluster detection method name, or 'none' (single process).
  """
  mode: str = "none"
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  timeouts: Timeouts = Timeouts()


def _flag(holder, env: Mapping[str, str], key: str, cast=str):
  """A flag's value if flags are parsed and it was given, else env[key] (cast), else None."""
  if flags.FLAGS.is_parsed() and holder.value is not None:
    return holder.value
  return cast(env[key]) if env.get(key) not in (None, "") else None


def settings_from_flags_and_env(env: Mapping[str, str] | None = None) -> DistributedSettings:
  """Resolves `DistributedSettings` from the flags (if parsed) and `env` (default os.environ)."""
  env = os.environ if env is None else env
  coord = _flag(_COORD, env, "GEM_JAX_COORDINATOR")
  nproc = _flag(_NPROC, env, "GEM_JAX_NUM_PROCESSES", int)
  pid = _flag(_PID, env, "GEM_JAX_PROCESS_ID", int)
  asked = _flag(_MODE, env, "GEM_JAX_DISTRIBUTED")
  mode = asked or "none"
  d = Timeouts()
  timeouts = Timeouts(
      heartbeat_s=_flag(_HEARTBEAT, env, "GEM_JAX_HEARTBEAT_TIMEOUT_S", int) or d.heartbeat_s,
      initialization_s=(_flag(_INIT_TIMEOUT, env, "GEM_JAX_INIT_TIMEOUT_S", int)
                        or d.initialization_s),
      shutdown_s=int(env.get("GEM_JAX_SHUTDOWN_TIMEOUT_S") or d.shutdown_s))
  if coord:
    if nproc is None or pid is None:
      raise ValueError("a coordinator address needs num_processes and process_id too "
                       "(--num_processes/--process_id or GEM_JAX_NUM_PROCESSES/_PROCESS_ID)")
    if not 0 <= pid < nproc:
      raise ValueError(f"process_id {pid} not in [0, {nproc})")
    return DistributedSettings("explicit", coord, nproc, pid, timeouts)
  if mode not in ("none", "", "off"):
    return DistributedSettings(mode, None, nproc, pid, timeouts)
  launcher = launcher_tasks(env)
  if asked is None and launcher is not None and launcher[1] > 1:
    name, n = launcher
    raise ValueError(
        f"started by {name} as one of {n} tasks, but no multi-process setup was asked for: "
        f"pass --distributed=auto (or GEM_JAX_DISTRIBUTED=auto: JAX's {name} detection) or "
        "--coordinator_address/--num_processes/--process_id; --distributed=none runs every "
        "task as an independent single-process run")
  return DistributedSettings("none", timeouts=timeouts)


def launcher_tasks(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
  """('slurm' | 'ompi', number of tasks) if `env` is a SLURM step or an Open MPI job.

  The same variables JAX's own detection reads (`jax._src.clusters.SlurmCluster`,
  `OmpiCluster`), Open MPI first as there.
  """
  env = os.environ if env is None else env
  if "OMPI_MCA_orte_hnp_uri" in env and env.get("OMPI_COMM_WORLD_SIZE", "").isdigit():
    return "ompi", int(env["OMPI_COMM_WORLD_SIZE"])
  slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
           "SLURM_LOCALID")
  if all(k in env for k in slurm) and env["SLURM_NTASKS"].isdigit():
    return "slurm", int(env["SLURM_NTASKS"])
  return None


def initialize(settings: DistributedSettings) -> bool:
  """Starts `jax.distributed` as `settings` say; returns whether it did.

  Must run before any other JAX call that touches devices. On CPU the
  cross-process collectives use gloo.
  """
  if settings.mode == "none":
    return False
  t = settings.timeouts
  kw: dict[str, Any] = dict(initialization_timeout=t.initialization_s,
                            heartbeat_timeout_seconds=t.heartbeat_s,
                            shutdown_timeout_seconds=t.shutdown_s)
  # CPU collectives across processes (the default in recent JAX; harmless on GPU runs).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if settings.mode == "explicit":
    jax.distributed.initialize(settings.coordinator, num_processes=settings.num_processes,
                               process_id=settings.process_id, **kw)
  else:
    if settings.mode != "auto":
      kw["cluster_detection_method"] = settings.mode
    jax.distributed.initialize(num_processes=settings.num_processes,
                               process_id=settings.process_id, **kw)
  tag_log_lines()
  if jax.process_count() > 1 and os.environ.get("GEM_JAX_MULTIPROCESS_CACHE", "0") != "1":
    # JAX writes persistent-cache entries from process 0 only and the keys differ per
    # process, so on a restart process 0 loads its programs in seconds while the
    # others compile for minutes; that skew overruns the collectives' rendezvous
    # (gloo: 30 s) at the first step. Every process compiles instead.
    jax.config.update("jax_enable_compilation_cache", False)
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def maybe_initialize(env: Mapping[str, str] | None = None) -> bool:
  """Initialises jax.distributed if the flags or the environment ask for it."""
  return initialize(settings_from_flags_and_env(env))


class _ProcessTag(pylogging.Filter):
  """Prefixes every record with `[process i/N]`."""

  def __init__(self, index: int, count: int):
    super().__init__()
    self.tag = f"[process {index}/{count}] "

  def filter(self, record):
    if not str(record.msg).startswith(self.tag):
      record.msg = self.tag + str(record.msg)
    return True


def tag_log_lines() -> None:
  """Adds `[process i/N]` to every absl log line of this process (multi-process runs)."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _ProcessTag) for f in handler.filters):
    handler.addFilter(_ProcessTag(jax.process_index(), jax.process_count()))


# ----------------------------------------------------- cross-process values --

def allgather_json(value: Any) -> list[Any]:
  """Every process's JSON-serialisable `value`, indexed by process (a collective).

  All processes must call it. One process: `[value]` without any communication.
  """
  if jax.process_count() == 1:
    return [value]
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
  n = multihost_utils.process_allgather(np.array([raw.size], np.int32))  # (P, 1)
  buf = np.zeros(int(n.max()), np.uint8)
  buf[:raw.size] = raw
  every = multihost_utils.process_allgather(buf)  # (P, max_len)
  return [json.loads(bytes(every[p, :int(n[p, 0])]).decode()) for p in range(every.shape[0])]


def data_positions(position: Any) -> dict:
  """The data-iterator state to checkpoint: this (process 0's) and every process's.

  All processes walk the same global record order, so `position` (what a
  restart with any process count resumes from) is the same on each of them,
  except for per-process bookkeeping such as bad-row counts; `by_process` keeps
  every process's own state so a restart with the same process count gets its
  own back exactly. A collective: every process calls it.
  """
  every = allgather_json(position)
  return {"position": every[0], "by_process": every}


def own_data_position(saved: Any) -> Any:
  """This process's iterator state from `data_positions(...)` (or a plain saved state)."""
  if not isinstance(saved, dict) or "by_process" not in saved:
    return saved
  every = saved["by_process"]
  if len(every) == jax.process_count():
    return every[jax.process_index()]
  return saved["position"]
