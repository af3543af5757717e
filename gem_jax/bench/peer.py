"""The TorchRec peer (benchmarks/torchrec/bench.py): its data as a gem_jax source, its command.

Both sides train on `gem_jax.bench.peer_data` (numpy only): `PeerSource` gives
its arrays as gem_jax batches, and benchmarks/torchrec/bench.py imports the same
module from the checkout, so ids, dense features and labels are identical. The
samplers come from `default_rng(seed)` and the batches from `default_rng(seed + 1)`;
a pool of `pool` batches (the peer's `--batch-pool`) is generated once and cycled,
so data generation is outside the timed steps on both sides.

Batch contract (gem_jax.data.spec) of one peer batch of B examples, T tables:
  dense (B, 13) float32, ids {'f0'..'f{T-1}': int64 (B, L)}, labels (B, 1),
  label_mask ones (B, 1), domain zeros (B,), no sequences.

The peer runs in its own virtualenv (`bash benchmarks/torchrec/setup.sh`, default
~/.cache/gem_jax/torchrec-venv; GEM_JAX_TORCHREC_PYTHON overrides its python), as a
subprocess, never at the same time as the gem_jax steps. torch is never imported here.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import Any, Sequence

import numpy as np

from gem_jax.bench import peer_data
from gem_jax.data import registry
from gem_jax.data.spec import DataSpec, SparseFeatureSpec

NUM_DENSE = peer_data.NUM_DENSE
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_SCRIPT = os.path.join(_REPO, "benchmarks", "torchrec", "bench.py")
PEER_MATMUL_SCRIPT = os.path.join(_REPO, "benchmarks", "torchrec", "matmul.py")
SETUP_HINT = "bash benchmarks/torchrec/setup.sh"
DEFAULT_VENV_PYTHON = os.path.join("~", ".cache", "gem_jax", "torchrec-venv", "bin", "python")


def peer_python(python: str | None = None) -> str:
  """The peer's interpreter: `python`, else $GEM_JAX_TORCHREC_PYTHON, else the default venv."""
  return os.path.expanduser(python or os.environ.get("GEM_JAX_TORCHREC_PYTHON",
                                                     DEFAULT_VENV_PYTHON))


def peer_spec(num_tables: int = 8, rows: int = 100_000, pooling: int = 1) -> DataSpec:
  """One sum-pooled feature 'f{i}' per table (the peer's keys), 13 dense, one task."""
  sparse = tuple(SparseFeatureSpec(f"f{i}", vocab=rows, bag=pooling) for i in range(num_tables))
  return DataSpec(n_dense=NUM_DENSE, sparse=sparse, num_domains=1, tasks=("click",))


def to_batch(dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> dict:
  """A peer_data batch (dense (B,13), ids (T,B,L), labels (B,)) as a gem_jax batch dict."""
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
  """The peer's synthetic batches (`peer_data`, identical arrays), as a gem_jax data source.

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
    self.data = peer_data.PeerData(num_tables, rows, pooling, alpha, seed, permute)
    self._pools: dict[int, list] = {}

  @classmethod
  def from_config(cls, data_cfg: Any, split: str = "train") -> "PeerSource":
    get = data_cfg.get
    return cls(num_tables=get("num_tables", 8), rows=get("rows", 100_000),
               pooling=get("pooling", 1), alpha=get("alpha", 1.05),
               seed=get("peer_seed", 0) + (0 if split == "train" else 1000),
               pool=get("pool", 32))

  def describe(self) -> str:
    return f"peer_data synthetic ({self.num_tables} x {self.rows}, seed {self.seed})"

  def pool(self, batch_size: int) -> list[dict]:
    """The `pool` batches of `batch_size` rows: peer_data's first `pool` batches."""
    if batch_size not in self._pools:
      self._pools[batch_size] = [to_batch(*b) for b in self.data.pool(batch_size, self.pool_size)]
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
                 pooling: int = 1, alpha: float = 1.05, bottom_mlp: Sequence[int] = (512, 256),
                 top_mlp: Sequence[int] = (512, 256), dcn_layers: int = 3, dcn_rank: int = 512,
                 lr: float = 0.1, optimizer: str = "sgd", threads: int = 2, seed: int = 0,
                 pool: int = 32, autocast: str = "off", python: str | None = None,
                 script: str | None = None, extra: Sequence[str] = ()) -> list[str]:
  """argv of one synthetic peer run with exactly these model/data settings.

  `script` defaults to benchmarks/torchrec/bench.py; any script taking the same flags
  works (e.g. ../shared/peers/torchrec_bench.py, as a cross-check).
  """
  if autocast not in ("off", "bf16"):
    raise ValueError(f"autocast must be 'off' or 'bf16', got {autocast!r}")
  cmd = [peer_python(python), os.path.abspath(script or PEER_SCRIPT),
         "--interaction", interaction, "--batch-size", str(batch_size),
         "--steps", str(steps), "--warmup", str(warmup), "--num-tables", str(num_tables),
         "--rows", str(rows), "--dim", str(dim), "--pooling", str(pooling),
         "--alpha", repr(float(alpha)),
         "--bottom-mlp", ",".join(str(h) for h in bottom_mlp),
         "--top-mlp", ",".join(str(h) for h in top_mlp), "--optimizer", optimizer,
         "--lr", repr(float(lr)), "--threads", str(threads), "--seed", str(seed),
         "--batch-pool", str(pool), "--autocast", autocast]
  if interaction == "dcn":
    cmd += ["--dcn-layers", str(dcn_layers), "--dcn-rank", str(dcn_rank)]
  return cmd + list(extra)


def peer_autocast(config) -> str:
  """The peer precision matching gem_jax's: bf16 (or fp8) compute -> 'bf16', fp32 -> 'off'.

  gem_jax's policy is bf16 matmul operands with fp32 accumulation, fp32 weights, tables
  and optimizer; the peer's `--autocast bf16` is torch.autocast over its dense part with
  fp32 tables, optimizer and loss: the same split. (fp8 has no CPU peer; bf16 is nearest.)
  """
  m = config.model
  return "bf16" if m.get("fp8", False) or str(m.get("dtype", "float32")) in (
      "bfloat16", "bf16") else "off"


def peer_command_from_config(config, *, steps: int, warmup: int, threads: int = 2,
                             python: str | None = None, script: str | None = None,
                             autocast: str | None = None) -> list[str]:
  """`peer_command` for a dlrm_peer-style run config (same model, data, optimizer, precision).

  `autocast` None: the config's precision (`peer_autocast`).
  """
  from gem_jax.train import setup  # pylint: disable=import-outside-toplevel
  cfg = setup.model_config(config.model)
  d = config.data
  return peer_command(
      interaction="dcn" if config.model.name == "dcnv2" else "dot", batch_size=d.batch_size,
      steps=steps, warmup=warmup, num_tables=d.num_tables, rows=d.rows, dim=config.embedding.dim,
      pooling=d.pooling, alpha=d.get("alpha", 1.05), bottom_mlp=cfg.bottom_mlp,
      top_mlp=cfg.top_mlp, dcn_layers=cfg.dcn_layers, dcn_rank=cfg.dcn_rank, lr=config.optim.lr,
      optimizer=config.optim.name, threads=threads, seed=d.peer_seed, pool=d.pool,
      autocast=autocast or peer_autocast(config), python=python, script=script)


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


def peer_dot_times(dots: Sequence[dict], *, threads: int = 2, python: str | None = None,
                   timeout_s: float = 900.0) -> list[float | None]:
  """torch's ms per call of each dot (`DotShape.as_dict()` form), in the peer's venv.

  benchmarks/torchrec/matmul.py runs each as `torch.einsum` on the same shapes and
  dtype with `threads` intra-op threads; None where the dtype has no torch like
  (mixed operands). The order of `dots` is kept.
  """
  keys = ("lhs", "rhs", "contract", "batch", "dtype")
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump([{k: d[k] for k in keys} for d in dots], f)
  try:
    out = run_peer([peer_python(python), PEER_MATMUL_SCRIPT, f.name, "--threads", str(threads)],
                   timeout_s)
  finally:
    os.unlink(f.name)
  got = out["dots"]
  if len(got) != len(dots):
    raise RuntimeError(f"peer matmul timing: {len(got)} results for {len(dots)} dots")
  return [g["ms"] for g in got]


def matmul_side_by_side(dots: Sequence[dict], peer_ms: Sequence[float | None]) -> dict:
  """Per-step dot time of both sides on the same shapes: sum of count x ms per call.

  dots: `DotShape.as_dict()` rows with gem_jax's `count` and `ms` per call.
  Only dots both sides timed count in the totals; `rows` are sorted by gem_jax's
  total time per step (each: shape, count, both ms per step, gem_jax / torch).
  """
  rows = []
  for d, t in zip(dots, peer_ms):
    mine = d["count"] * d["ms"]
    theirs = None if t is None else d["count"] * t
    rows.append({"shape": d["shape"], "count": d["count"], "gem_jax_ms": mine, "torch_ms": theirs,
                 "ratio": mine / theirs if theirs else None})
  rows.sort(key=lambda r: -r["gem_jax_ms"])
  both = [r for r in rows if r["torch_ms"] is not None]
  g = sum(r["gem_jax_ms"] for r in both)
  t = sum(r["torch_ms"] for r in both)
  return {"summary": "matmul_side_by_side", "gem_jax_dot_ms": g, "torch_dot_ms": t,
          "ratio": g / t if t else float("nan"), "untimed_by_peer": len(rows) - len(both),
          "rows": rows}


def run_peer(cmd: Sequence[str], timeout_s: float = 1800.0) -> dict:
  """Runs the peer command (blocking); returns its JSON dict.

  Raises:
    FileNotFoundError when the venv python or the script is missing (with the setup hint);
    RuntimeError with the peer's stderr tail when it fails.
  """
  python, script = cmd[0], cmd[1]
  if not os.path.exists(python):
    raise FileNotFoundError(f"no TorchRec venv python at {python}: create it with "
                            f"`{SETUP_HINT}` or set GEM_JAX_TORCHREC_PYTHON")
  if not os.path.exists(script):
    raise FileNotFoundError(f"peer script {script} not found (benchmarks/torchrec/bench.py "
                            f"ships with the checkout; venv: `{SETUP_HINT}`)")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.pop("PYTHONPATH", None)
  p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s, env=env,
                     check=False)
  if p.returncode != 0:
    raise RuntimeError(f"peer failed (exit {p.returncode}): {p.stderr[-2000:]}")
  return parse_peer_output(p.stdout)
