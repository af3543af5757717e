"""Multi-process start-up: `maybe_initialize()` before any other JAX call.

On a cluster each process runs the same command; JAX needs to know the
coordinator. We call `jax.distributed.initialize()` when either
  * GEM_JAX_COORDINATOR=host:port, GEM_JAX_NUM_PROCESSES, GEM_JAX_PROCESS_ID are set
    (explicit, also used by the local multi-process tests), or
  * a cluster environment JAX detects by itself is present (SLURM, Open MPI,
    Cloud TPU: `GEM_JAX_DISTRIBUTED=auto`).
Otherwise the run is single-process and nothing happens.
"""
from __future__ import annotations

import os

import jax


def maybe_initialize() -> bool:
  """Initialises jax.distributed if the environment asks for it; returns whether it did."""
  coord = os.environ.get("GEM_JAX_COORDINATOR")
  if coord:
    if jax.default_backend() == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coord, num_processes=int(os.environ["GEM_JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["GEM_JAX_PROCESS_ID"]))
    return True
  if os.environ.get("GEM_JAX_DISTRIBUTED") == "auto":
    jax.distributed.initialize()
    return True
  return False
