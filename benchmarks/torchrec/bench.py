#!/usr/bin/env python3
"""TorchRec side of the gem_jax comparison: DLRM (dot) or DLRM_DCN trained on CPU.

  V=~/.cache/gem_jax/torchrec-venv/bin/python        # bash benchmarks/torchrec/setup.sh
  $V benchmarks/torchrec/bench.py                     # 8 x 100k x 64, batch 4096, SGD, dot
  $V benchmarks/torchrec/bench.py --interaction dcn --autocast bf16

Data: gem_jax.bench.peer_data (imported from this checkout, numpy only), the same
arrays gem_jax's `torchrec_synthetic` source feeds configs/dlrm_peer.py; `--batch-pool`
batches are generated before the timed loop and cycled. The KeyedJaggedTensor is built
inside each step.

Model: torchrec.models.dlrm.DLRM / DLRM_DCN; bottom MLP 13 -> bottom -> dim (ReLU after
every layer), top MLP -> top -> 1, mean BCE with logits. Tables: one per feature,
sum pooling, in a FusedEmbeddingBagCollection (FBGEMM table-batched CPU kernels, the
optimizer applied inside backward: SGD w -= lr g; Adagrad s += g^2,
w -= lr g / (sqrt(s) + eps); row-wise Adagrad s_row += mean(g^2)), else a plain
EmbeddingBagCollection with sparse gradients and torch.optim (`--emb-impl`).
Dense parameters: SGD for `--optimizer sgd`, Adagrad otherwise.
`--autocast bf16`: the forward under torch.autocast('cpu', bfloat16) (the dense
matmuls); tables, optimizer state and the loss stay fp32.

Prints one JSON line on stdout (logs on stderr): examples_per_s (batch / median
timed step), step_ms_*, loss_first/last, versions, threads, emb_impl, autocast,
own_busy_cores / other_busy_cores (CPU used by this process / by others during the
timed steps; others > ~0.1 means the figure is contaminated).
"""
from __future__ import annotations

# torch and torchrec are imported where they are used:
# pylint: disable=import-outside-toplevel

import argparse
import contextlib
import json
import os
import platform
import resource
import sys
import time

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)
from gem_jax.bench import peer_data  # noqa: E402  pylint: disable=wrong-import-position

DEFAULT_LR = {"sgd": 0.1, "adagrad": 0.02, "rowwise_adagrad": 0.02}
ADAGRAD_EPS = 1e-8


def log(msg: str) -> None:
  print(f"[torchrec/bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--interaction", choices=["dot", "dcn"], default="dot")
  p.add_argument("--batch-size", type=int, default=4096)
  p.add_argument("--steps", type=int, default=20, help="timed steps")
  p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
  p.add_argument("--num-tables", type=int, default=8, help="tables, one feature each")
  p.add_argument("--rows", type=int, default=100_000, help="rows per table")
  p.add_argument("--dim", type=int, default=64, help="embedding dim (= bottom MLP output)")
  p.add_argument("--pooling", type=int, default=1, help="ids per table per example (sum)")
  p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
  p.add_argument("--no-permute", action="store_true", help="row id = Zipf rank")
  p.add_argument("--bottom-mlp", default="512,256", help="hidden sizes; --dim is appended")
  p.add_argument("--top-mlp", default="512,256", help="hidden sizes; 1 is appended")
  p.add_argument("--dcn-layers", type=int, default=3)
  p.add_argument("--dcn-rank", type=int, default=512)
  p.add_argument("--optimizer", choices=["sgd", "adagrad", "rowwise_adagrad"], default="sgd")
  p.add_argument("--lr", type=float, default=None, help="default: sgd 0.1, adagrad 0.02")
  p.add_argument("--emb-impl", choices=["auto", "fused", "ebc"], default="auto",
                 help="auto: fused, falling back to ebc")
  p.add_argument("--autocast", choices=["off", "bf16"], default="off")
  p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
  p.add_argument("--interop-threads", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch-pool", type=int, default=32, help="distinct batches, cycled")
  a = p.parse_args(argv)
  if a.lr is None:
    a.lr = DEFAULT_LR[a.optimizer]
  if min(a.batch_size, a.steps, a.num_tables, a.rows, a.dim, a.pooling, a.batch_pool) < 1:
    p.error("--batch-size --steps --num-tables --rows --dim --pooling --batch-pool must be >= 1")
  return a


def _sizes(text: str) -> list[int]:
  return [int(h) for h in text.split(",") if h.strip()]


# ------------------------------------------------------------------ CPU meter --

def _busy_cpu_s() -> float | None:
  """Machine-wide non-idle CPU seconds since boot (/proc/stat), None off Linux."""
  try:
    with open("/proc/stat", encoding="ascii") as f:
      ticks = [int(v) for v in f.readline().split()[1:9]]
  except (OSError, ValueError):
    return None
  idle = ticks[3] + ticks[4]  # idle + iowait
  return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
  """own = this process' CPU s / wall s; other = machine busy cores - own (>= 0)."""

  def __init__(self):
    self.wall0, self.own0, self.all0 = time.perf_counter(), self._own(), _busy_cpu_s()

  @staticmethod
  def _own() -> float:
    t = os.times()
    return t.user + t.system

  def read(self) -> dict:
    wall = max(time.perf_counter() - self.wall0, 1e-9)
    own = (self._own() - self.own0) / wall
    all1 = _busy_cpu_s()
    other = None if all1 is None or self.all0 is None else max(0.0, (all1 - self.all0) / wall - own)
    return {"own_busy_cores": round(own, 2),
            "other_busy_cores": None if other is None else round(other, 2),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------------- model --

class Trainer:
  """DLRM / DLRM_DCN, its optimizers, and one training step."""

  def __init__(self, args: argparse.Namespace, impl: str):
    import torch
    import torchrec
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import PoolingType
    self.torch, self.args, self.impl = torch, args, impl
    self.keys = [f"f{i}" for i in range(args.num_tables)]
    torch.manual_seed(args.seed)
    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim,
                                          num_embeddings=args.rows, feature_names=[k],
                                          pooling=PoolingType.SUM)
              for i, k in enumerate(self.keys)]
    kw = {"lr": args.lr} if args.optimizer == "sgd" else {"lr": args.lr, "eps": ADAGRAD_EPS}
    self.emb_opt = None
    if impl == "fused":
      from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
      import torchrec.optim as trec_optim
      emb_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
                 "rowwise_adagrad": trec_optim.RowWiseAdagrad}[args.optimizer]
      ebc = FusedEmbeddingBagCollection(tables=tables, optimizer_type=emb_cls,
                                        optimizer_kwargs=dict(kw), device=torch.device("cpu"))
      self.emb_desc = f"FusedEmbeddingBagCollection (FBGEMM TBE CPU), fused {self._tbe_opt(ebc)}"
    elif impl == "ebc":
      if args.optimizer == "rowwise_adagrad":
        raise SystemExit("--emb-impl ebc: torch has no sparse row-wise Adagrad; use fused")
      ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
      for bag in ebc.embedding_bags.values():
        bag.sparse = True  # row gradients, not a dense (rows, dim) one per table
      emb_cls = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.Adagrad
      self.emb_opt = emb_cls(list(ebc.parameters()), **kw)
      self.emb_desc = f"EmbeddingBagCollection sparse grads + torch.optim.{emb_cls.__name__}"
    else:
      raise ValueError(f"unknown --emb-impl {impl!r}")
    bottom = _sizes(args.bottom_mlp) + [args.dim]
    top = _sizes(args.top_mlp) + [1]
    common = dict(embedding_bag_collection=ebc, dense_in_features=peer_data.NUM_DENSE,
                  dense_arch_layer_sizes=bottom, over_arch_layer_sizes=top)
    self.model = (DLRM(**common) if args.interaction == "dot" else
                  DLRM_DCN(**common, dcn_num_layers=args.dcn_layers,
                           dcn_low_rank_dim=args.dcn_rank))
    dense = [p for n, p in self.model.named_parameters() if not n.startswith("sparse_arch.")]
    dense_cls = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.Adagrad
    self.dense_opt = dense_cls(dense, **kw)
    self.dense_desc = f"torch.optim.{dense_cls.__name__}"
    self.dense_params = sum(p.numel() for p in dense)
    self.loss_fn = torch.nn.BCEWithLogitsLoss()

  @staticmethod
  def _tbe_opt(ebc) -> str:
    """FBGEMM's optimizer name (EXACT_SGD, ...), from private attributes when present."""
    try:
      return ebc._emb_modules[0]._emb_module.optimizer.name  # pylint: disable=protected-access
    except (AttributeError, IndexError):
      return "optimizer"

  def kjt(self, ids):
    """ids (T, B, L) -> KeyedJaggedTensor of T keys x B bags of L ids each."""
    from torchrec import KeyedJaggedTensor
    t, b, l = ids.shape
    lengths = self.torch.full((t * b,), l, dtype=self.torch.int64)
    return KeyedJaggedTensor(keys=self.keys, values=ids.reshape(-1), lengths=lengths, stride=b)

  def autocast(self):
    if self.args.autocast == "bf16":
      return self.torch.autocast("cpu", dtype=self.torch.bfloat16)
    return contextlib.nullcontext()

  def step(self, dense, ids, labels) -> float:
    """One SGD/Adagrad step on (dense (B,13), ids (T,B,L), labels (B,)); returns the loss."""
    with self.autocast():
      logits = self.model(dense, self.kjt(ids)).squeeze(-1)  # (B,)
    loss = self.loss_fn(logits.float(), labels)  # fp32 loss
    self.dense_opt.zero_grad(set_to_none=True)
    if self.emb_opt is not None:
      self.emb_opt.zero_grad(set_to_none=True)
    loss.backward()  # the fused tables update here
    self.dense_opt.step()
    if self.emb_opt is not None:
      self.emb_opt.step()
    return float(loss.detach())

  def probe(self) -> None:
    """A small forward, so a broken fused kernel shows before the timed loop."""
    torch = self.torch
    ids = torch.zeros((len(self.keys), 2, 1), dtype=torch.int64)
    with torch.no_grad(), self.autocast():
      self.model(torch.zeros(2, peer_data.NUM_DENSE), self.kjt(ids))


def build(args) -> tuple[Trainer, list[str]]:
  errors = []
  for impl in (["fused", "ebc"] if args.emb_impl == "auto" else [args.emb_impl]):
    try:
      tr = Trainer(args, impl)
      tr.probe()
      return tr, errors
    except SystemExit:
      raise
    except Exception as e:  # pylint: disable=broad-except
      errors.append(f"{impl}: {type(e).__name__}: {e}"[:300])
      log(f"embedding impl {impl} failed: {errors[-1]}")
  raise SystemExit("no embedding implementation worked: " + "; ".join(errors))


# ------------------------------------------------------------------------ run --

def versions() -> dict:
  import torch
  from importlib import metadata
  out = {"torch": torch.__version__, "python": platform.python_version()}
  for dist, key in (("torchrec", "torchrec"), ("fbgemm-gpu-cpu", "fbgemm_gpu_cpu")):
    try:
      out[key] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      out[key] = None
  return out


def run(args) -> dict:
  import torch
  torch.set_num_threads(args.threads)
  torch.set_num_interop_threads(args.interop_threads)
  data = peer_data.PeerData(args.num_tables, args.rows, args.pooling, args.alpha, args.seed,
                            permute=not args.no_permute)
  total = args.warmup + args.steps
  n_pool = min(total, args.batch_pool)  # the first batches of a --batch-pool pool
  pool = [tuple(torch.from_numpy(a) for a in b) for b in data.pool(args.batch_size, n_pool)]
  tr, errors = build(args)
  log(f"{tr.impl}: {tr.emb_desc}; dense {tr.dense_desc}; autocast {args.autocast}; "
      f"{args.threads} threads")
  losses, times, meter = [], [], None
  t_start = time.perf_counter()
  for i in range(total):
    if i == args.warmup:
      meter = CpuMeter()
    t0 = time.perf_counter()
    losses.append(tr.step(*pool[i % n_pool]))
    if i >= args.warmup:
      times.append(time.perf_counter() - t0)
  cpu = meter.read()
  wall = time.perf_counter() - t_start
  ms = np.asarray(times) * 1e3
  med = float(np.median(ms))
  out = {
      "framework": "torchrec", "mode": "synthetic", "script": "benchmarks/torchrec/bench.py",
      "data": "gem_jax.bench.peer_data",
      "examples_per_s": round(args.batch_size / (med / 1e3), 1),
      "step_ms_median": round(med, 3), "step_ms_mean": round(float(ms.mean()), 3),
      "step_ms_p90": round(float(np.percentile(ms, 90)), 3),
      "step_ms_min": round(float(ms.min()), 3), "step_ms_max": round(float(ms.max()), 3),
      "steps": args.steps, "warmup_steps": args.warmup, "batch_size": args.batch_size,
      "num_tables": args.num_tables, "rows_per_table": args.rows, "dim": args.dim,
      "pooling": args.pooling, "zipf_alpha": args.alpha, "zipf_permuted": not args.no_permute,
      "distinct_batches": n_pool, "seed": args.seed, "interaction": args.interaction,
      "bottom_mlp": f"{args.bottom_mlp},{args.dim}", "top_mlp": f"{args.top_mlp},1",
      "optimizer": args.optimizer, "lr": args.lr, "emb_impl": tr.impl,
      "emb_optimizer": tr.emb_desc, "dense_optimizer": tr.dense_desc,
      "dense_params": tr.dense_params, "autocast": args.autocast,
      "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
      "loss_first": round(losses[0], 5), "loss_last": round(losses[-1], 5),
      "losses": [round(l, 5) for l in losses], "wall_s": round(wall, 3),
  }
  out.update(versions())
  out.update(cpu)
  if errors:
    out["fallback_errors"] = errors
  out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
  return out


def main(argv=None) -> None:
  import warnings
  warnings.filterwarnings("ignore")  # torchrec's import-time notices; errors still raise
  print(json.dumps(run(parse_args(argv))), flush=True)


if __name__ == "__main__":
  main()
