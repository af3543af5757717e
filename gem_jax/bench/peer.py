"""The TorchRec peer (../shared/peers/torchrec_bench.py): its data as a gem_jax source, its command.

Same ids, dense features and labels as the peer: its numpy generators are
imported from `torchrec_bench` (torch is imported there lazily, so gem_jax never
needs torch). The peer builds its Zipf samplers from `default_rng(seed)` and
draws batches from `default_rng(seed + 1)`; `PeerSource` does the same and
cycles a pre-generated pool of `pool` batches (the peer's `--batch-pool`), so
data generation is outside the timed steps on both sides.

Batch contract (gem_jax.data.spec) of one peer batch of B examples, T tables:
  dense (B, 13) float32, ids {'f0'..'f{T-1}': int64 (B, L)}, labels (B, 1),
  label_mask ones (B, 1), domain zeros (B,), no sequences.

The peer runs in its own virtualenv (made by ../shared/peers/setup_torchrec.sh),
as a subprocess, never at the same time as the gem_jax steps.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any, Sequence

import numpy as np

from gem_jax.data import registry
from gem_jax.data.spec import DataSpec, SparseFeatureSpec

NUM_DENSE = 13
DEFAULT_VENV_PYTHON = os.path.join("~", ".cache", "gem_jax-peers", "torchrec-venv", "bin", "python")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peers_dir() -> str:
  """$GEM_JAX_PEERS_DIR, else ../shared/peers beside the checkout."""
  return os.path.abspath(os.environ.get("GEM_JAX_PEERS_DIR",
                                        os.path.join(_REPO, "..", "shared", "peers")))


def peer_module():
  """The peer's `torchrec_bench` module (numpy-only at import)."""
  d = peers_dir()
  if d not in sys.path:
    sys.path.insert(0, d)
  try:
    return importlib.import_module("torchrec_bench")
  except ImportError as e:
    raise FileNotFoundError(f"torchrec_bench.py not found in {d} (set GEM_JAX_PEERS_DIR)") from e


def peer_spec(num_tables: int = 8, rows: int = 100_000, pooling: int = 1) -> DataSpec:
  """One sum-pooled feature 'f{i}' per table (the peer's keys), 13 dense, one task."""
  sparse = tuple(SparseFeatureSpec(f"f{i}", vocab=rows, bag=pooling) for i in range(num_tables))
  return DataSpec(n_dense=NUM_DENSE, sparse=sparse, num_domains=1, tasks=("click",))


def to_batch(dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> dict:
  """The peer's (dense (B,13), ids (T,B,L), labels (B,)) as a gem_jax batch dict."""
  b = dense.shape[0]
  return {
      "dense": np.asarray(dense, np.float32),
      "ids": {f"f{i}": np.asarray(ids[i]) for i in range(ids.shape[0])},  # (B, L)
      "seq": {},
      "domain": np.zeros((b,), np.int32),
      "labels": np.asarray(labels, np.float32)[:, None],
      "label_mask": np.ones((b, 1), np.float32),
  }


class _PoolIterator:
  """Cycles a list of batches; `state()` is the position (for checkpoints)."""

  def __init__(self, pool: list, start: int = 0, repeat: bool = True):
    self.pool, self.i, self.repeat = pool, int(start), repeat

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if not self.repeat and self.i >= len(self.pool):
      raise StopIteration
    out = self.pool[self.i % len(self.pool)]
    self.i += 1
    return out

  def state(self) -> dict:
    return {"i": self.i}

  def close(self) -> None:
    pass


class PeerSource:
  """The peer's synthetic batches (identical arrays), as a gem_jax data source.

  Args:
    num_tables, rows, pooling, alpha, seed, permute: the peer's flags
      (`--num-tables --rows --pooling --alpha --seed --no-permute`).
    pool: distinct batches generated once and cycled (the peer's `--batch-pool`).
  """

  def __init__(self, num_tables: int = 8, rows: int = 100_000, pooling: int = 1,
               alpha: float = 1.05, seed: int = 0, pool: int = 32, permute: bool = True):
    self.num_tables, self.rows, self.pooling = num_tables, rows, pooling
    self.alpha, self.seed, self.pool_size, self.permute = alpha, seed, pool, permute
    self.spec = peer_spec(num_tables, rows, pooling)
    self._pools: dict[int, list] = {}

  @classmethod
  def from_config(cls, data_cfg: Any, split: str = "train") -> "PeerSource":
    get = data_cfg.get
    return cls(num_tables=get("num_tables", 8), rows=get("rows", 100_000),
               pooling=get("pooling", 1), alpha=get("alpha", 1.05),
               seed=get("peer_seed", 0) + (0 if split == "train" else 1000),
               pool=get("pool", 32))

  def describe(self) -> str:
    return f"torchrec_bench synthetic ({self.num_tables} x {self.rows}, seed {self.seed})"

  def pool(self, batch_size: int) -> list[dict]:
    """The `pool` batches of `batch_size` rows, generated exactly as the peer does."""
    if batch_size not in self._pools:
      tb = peer_module()
      samplers = tb.make_samplers(self.num_tables, self.rows, self.alpha, self.seed,
                                  permute=self.permute)
      rng = np.random.default_rng(self.seed + 1)
      self._pools[batch_size] = [to_batch(*tb.synthetic_batch(samplers, batch_size,
                                                              self.pooling, rng))
                                 for _ in range(self.pool_size)]
    return self._pools[batch_size]

  def batches(self, batch_size: int, *, process_index: int = 0, process_count: int = 1,
              seed: int = 0, repeat: bool = True, state: dict | None = None):
    """Cycles the pool; processes read their row slice of each global batch."""
    del seed
    b = batch_size
    pool = self.pool(b * process_count)
    if process_count > 1:
      lo = process_index * b
      pool = [_slice(x, lo, lo + b) for x in pool]
    return _PoolIterator(pool, (state or {}).get("i", 0), repeat)


def _slice(batch: dict, lo: int, hi: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree.map(lambda x: x[lo:hi], batch)


registry.register("torchrec_synthetic", PeerSource.from_config)


# ------------------------------------------------------------------ the peer run --

def peer_command(*, interaction: str = "dot", batch_size: int = 4096, steps: int = 20,
                 warmup: int = 5, num_tables: int = 8, rows: int = 100_000, dim: int = 64,
                 pooling: int = 1, bottom_mlp: Sequence[int] = (512, 256),
                 top_mlp: Sequence[int] = (512, 256), dcn_layers: int = 3, dcn_rank: int = 512,
                 lr: float = 0.1, optimizer: str = "sgd", threads: int = 2, seed: int = 0,
                 pool: int = 32, python: str | None = None, script: str | None = None,
                 extra: Sequence[str] = ()) -> list[str]:
  """argv of one synthetic peer run with exactly these model/data settings."""
  python = os.path.expanduser(python or os.environ.get("GEM_JAX_TORCHREC_PYTHON",
                                                       DEFAULT_VENV_PYTHON))
  script = script or os.path.join(peers_dir(), "torchrec_bench.py")
  cmd = [python, script, "--interaction", interaction, "--batch-size", str(batch_size),
         "--steps", str(steps), "--warmup", str(warmup), "--num-tables", str(num_tables),
         "--rows", str(rows), "--dim", str(dim), "--pooling", str(pooling),
         "--bottom-mlp", ",".join(str(h) for h in bottom_mlp),
         "--top-mlp", ",".join(str(h) for h in top_mlp), "--optimizer", optimizer,
         "--lr", repr(float(lr)), "--threads", str(threads), "--seed", str(seed),
         "--batch-pool", str(pool)]
  if interaction == "dcn":
    cmd += ["--dcn-layers", str(dcn_layers), "--dcn-rank", str(dcn_rank)]
  return cmd + list(extra)


def peer_command_from_config(config, *, steps: int, warmup: int, threads: int = 2,
                             python: str | None = None) -> list[str]:
  """`peer_command` for a dlrm_peer-style run config (same model, data and optimizer)."""
  from gem_jax.models import config as model_config  # pylint: disable=import-outside-toplevel
  cfg = model_config.get_config(config.model.preset,
                                **{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in config.model.get("overrides", {}).items()})
  d = config.data
  return peer_command(
      interaction="dcn" if config.model.name == "dcnv2" else "dot", batch_size=d.batch_size,
      steps=steps, warmup=warmup, num_tables=d.num_tables, rows=d.rows, dim=config.embedding.dim,
      pooling=d.pooling, bottom_mlp=cfg.bottom_mlp, top_mlp=cfg.top_mlp,
      dcn_layers=cfg.dcn_layers, dcn_rank=cfg.dcn_rank, lr=config.optim.lr,
      optimizer=config.optim.name, threads=threads, seed=d.peer_seed, pool=d.pool,
      python=python)


def parse_peer_output(stdout: str) -> dict:
  """The peer's result: the last line of stdout that is a JSON object."""
  for line in reversed(stdout.strip().splitlines()):
    line = line.strip()
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        continue
  raise ValueError(f"no JSON line in the peer's output: {stdout[-500:]!r}")


def run_peer(cmd: Sequence[str], timeout_s: float = 1800.0) -> dict:
  """Runs the peer command (blocking); returns its JSON dict.

  Raises:
    FileNotFoundError when the venv python or the script is missing (with the setup hint);
    RuntimeError with the peer's stderr tail when it fails.
  """
  for path in cmd[:2]:
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} not found: create the TorchRec venv with "
                              f"`bash {os.path.join(peers_dir(), 'setup_torchrec.sh')}` "
                              "or set GEM_JAX_TORCHREC_PYTHON")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.pop("PYTHONPATH", None)
  p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s, env=env,
                     check=False)
  if p.returncode != 0:
    raise RuntimeError(f"peer failed (exit {p.returncode}): {p.stderr[-2000:]}")
  return parse_peer_output(p.stdout)
