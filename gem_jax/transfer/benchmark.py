"""The transfer benchmark: one teacher, six student variants, the same budget, several seeds.

  1. train the teacher with the trainer (`loop.train_and_evaluate`) on its data
     (planted: all domains, old labels; Avazu: the first 60% of the train file);
  2. generate its knowledge (logits, trunk) for the student's train and eval data;
  3. per variant and seed, train the same Student for the same steps on the
     same fresh rows and evaluate it on the student's eval rows:
       alone        BCE on the fresh labels only
       distill      + soft targets from the teacher logits
       adapter      + Student Adapter (distil from the adapted teacher)
       repr         teacher trunk as extra student input tokens (no distillation)
       share        tables + dense tokenizer initialised from the teacher (no distillation)
       all          everything together
  4. print one JSON line per variant: mean / std / min / max over seeds of eval
     AUC and NE, and the student's forward FLOPs per example.

Seeds change the student's initialisation; data and teacher are fixed, so the
spread is the student's training noise. Avazu's splits are written as CSV files
in the workdir (the sample has a single hour, so "older" means earlier in
the file).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Sequence

import jax
import ml_collections
import numpy as np

from gem_jax.data import registry as data_registry
from gem_jax.data.avazu import APP_SITE_ID
from gem_jax.data.synthetic import rank_auc
from gem_jax.train import loop
from gem_jax.train import predict
from gem_jax.train import setup as setup_lib
from gem_jax.transfer import generate
from gem_jax.transfer import knowledge as kn
from gem_jax.transfer import planted  # noqa: F401  (registers 'transfer_planted')
from gem_jax.transfer import train as ttrain
from gem_jax.transfer.student import TransferOptions, student_flops

VARIANTS = ("alone", "distill", "adapter", "repr", "share", "all")


@dataclasses.dataclass(frozen=True)
class Budget:
  """Sizes of one benchmark dataset (the defaults are the documented run)."""
  teacher_steps: int = 600
  student_steps: int = 200
  batch_size: int = 128
  student_train: int = 2048
  student_eval: int = 16384
  seeds: tuple[int, ...] = (0, 1, 2)


def variant_options(variant: str, n_tasks: int, teacher_dim: int, shared_tables: Sequence[str],
                    distill_weight: float = 1.0) -> TransferOptions:
  """The TransferOptions of a named variant."""
  w = (distill_weight,) * n_tasks
  share = dict(share_tables=tuple(shared_tables), share_blocks=("dense_tok",))
  return {
      "alone": TransferOptions(),
      "distill": TransferOptions(distill_weights=w),
      "adapter": TransferOptions(distill_weights=w, adapter=True),
      "repr": TransferOptions(teacher_emb="trunk", teacher_emb_dim=teacher_dim),
      "share": TransferOptions(**share),
      "all": TransferOptions(distill_weights=w, adapter=True, teacher_emb="trunk",
                             teacher_emb_dim=teacher_dim, **share),
  }[variant]


def _cfg(d: dict) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(d)


def teacher_config(base, data: dict, steps: int, batch_size: int) -> ml_collections.ConfigDict:
  """The teacher run config: `base` (configs/transfer_teacher_planted.py) with `data`."""
  c = ml_collections.ConfigDict(base.to_dict())
  c.data.update(data)
  c.data.batch_size = c.data.eval_batch_size = batch_size
  c.train.steps = c.train.eval_every = c.train.checkpoint_every = steps
  c.train.log_every = max(1, steps // 4)
  return c


def student_blocks():
  """(model GEMConfig, embedding block, optim block) of every student variant."""
  model = setup_lib.model_config(_cfg(dict(preset="tiny", dtype="float32", overrides=dict(
      d_model=16, num_blocks=1, wukong_nf=4, wukong_nl=4, wukong_k=4, wukong_mlp=(32,),
      trunk_hidden=(32,), head_hidden=(16,)))))
  emb = _cfg(dict(dim=16, optimizer="rowwise_adagrad", lr=0.05, warmup_steps=0, sharding="auto",
                  id_policy="hash", memory_budget_gb=1.0, share_tables=True))
  opt = _cfg(dict(name="adamw", lr=3e-3, warmup_steps=10, decay="cosine", weight_decay=0.0,
                  clip_norm=1.0))
  return model, emb, opt


def teacher_on(src_train, src_eval, teacher, workdir: str, batch_size: int) -> dict:
  """Knowledge of the student's train and eval rows -> KnowledgeSources; teacher eval AUC."""
  out = {}
  for split, src in (("train", src_train), ("eval", src_eval)):
    d = os.path.join(workdir, "knowledge", split)
    generate.generate_knowledge(teacher, src, d, batch_size=batch_size, fields=("trunk",))
    out[split] = kn.KnowledgeSource(src, d)
  # The stale teacher itself on the student's eval rows (reference line).
  zs, ys, ms = [], [], []
  for b in out["eval"].batches(batch_size, repeat=False):
    zs.append(b["teacher"]["logits"]), ys.append(b["labels"]), ms.append(b["label_mask"])
  z, y, m = (np.concatenate(v) for v in (zs, ys, ms))
  aucs = [rank_auc(z[m[:, t] > 0, t], y[m[:, t] > 0, t]) for t in range(z.shape[1])]
  out["teacher_auc"] = float(np.mean(aucs))
  return out


def run_variants(spec, sources: dict, teacher, mesh, budget: Budget, variants: Sequence[str],
                 shared_tables: Sequence[str], shared_vocab, emit: Callable[[dict], None],
                 dataset: str) -> list[dict]:
  """Trains every variant for every seed; emits and returns one summary per variant."""
  model_cfg, emb_cfg, opt_cfg = student_blocks()
  teacher_dim = int(np.prod(sources["train"].fields["trunk"]))
  rows = []
  for v in variants:
    opts = variant_options(v, len(spec.tasks), teacher_dim, shared_tables)
    run = ttrain.build_student_run(spec, mesh, model_cfg, emb_cfg, opt_cfg,
                                   steps=budget.student_steps, batch_size=budget.batch_size,
                                   opts=opts, shared_vocab=shared_vocab)
    per_seed = []
    for seed in budget.seeds:
      state = ttrain.init_student_state(run, seed, teacher)
      state, _, _ = ttrain.train_steps(run, state, sources["train"], steps=budget.student_steps,
                                       batch_size=budget.batch_size, seed=0)
      _, ev = ttrain.evaluate_student(run, state, sources["eval"], batch_size=budget.batch_size)
      per_seed.append({"seed": seed, "eval_auc": ev["eval_auc"], "eval_ne": ev["eval_ne"]})
    auc = np.array([r["eval_auc"] for r in per_seed])
    ne = np.array([r["eval_ne"] for r in per_seed])
    row = {"dataset": dataset, "variant": v,
           "eval_auc": float(auc.mean()), "eval_auc_std": float(auc.std()),
           "eval_auc_min": float(auc.min()), "eval_auc_max": float(auc.max()),
           "eval_ne": float(ne.mean()), "eval_ne_std": float(ne.std()),
           "student_flops_per_example": student_flops(model_cfg, spec, run.feature_dims,
                                                      opts.teacher_emb_dim)["total"],
           "steps": budget.student_steps, "batch_size": budget.batch_size,
           "seeds": list(budget.seeds), "per_seed": per_seed}
    emit(row)
    rows.append(row)
  return rows


# ---------------------------------------------------------------------- datasets --

def planted_benchmark(workdir: str, base_teacher_config, budget: Budget,
                      variants: Sequence[str], emit: Callable[[dict], None]) -> list[dict]:
  """The planted benchmark (gem_jax/transfer/planted.py)."""
  tcfg = teacher_config(base_teacher_config, dict(kind="transfer_planted", role="teacher",
                                                  seed=0), budget.teacher_steps, 256)
  tdir = os.path.join(workdir, "teacher")
  summary = loop.train_and_evaluate(tcfg, tdir)
  teacher = predict.restore_model(tcfg, tdir, budget.batch_size)
  sdata = _cfg(dict(kind="transfer_planted", role="student", seed=0,
                    train_examples=budget.student_train, eval_examples=budget.student_eval))
  src_train, src_eval = data_registry.make_sources(sdata)
  sources = teacher_on(src_train, src_eval, teacher, workdir, budget.batch_size)
  emit({"dataset": "planted", "variant": "teacher", "teacher_eval_auc": summary.get("eval_auc"),
        "teacher_auc_on_student_eval": sources["teacher_auc"],
        "student_oracle_auc": src_eval.oracle_auc(20000)["auc"],
        "teacher_steps": budget.teacher_steps})
  return run_variants(src_train.spec, sources, teacher, teacher.setup.mesh, budget, variants,
                      ("user", "ad", "category"), src_train.shared_vocab, emit, "planted")


def split_avazu(train_csv: str, dev_csv: str, out_dir: str, teacher_frac: float = 0.6,
                student_frac: float = 0.85) -> dict[str, str]:
  """Writes the Avazu transfer splits as CSV files (file order stands in for time).

    teacher.csv        rows [0, 60%) of the train file, both domains (older labels)
    student_train.csv  app rows in [60%, 85%) of the train file (fresh labels)
    student_eval.csv   app rows in [85%, 100%) of the train file + app rows of the dev file
  """
  os.makedirs(out_dir, exist_ok=True)

  def rows(path):
    with open(path, "rb") as f:
      return [l for l in f.read().splitlines() if l and not l.startswith(b"id,")]

  train, dev = rows(train_csv), rows(dev_csv)
  app = lambda l: l.split(b",")[5] == APP_SITE_ID  # noqa: E731
  a, b = int(len(train) * teacher_frac), int(len(train) * student_frac)
  parts = {"teacher": train[:a], "student_train": [l for l in train[a:b] if app(l)],
           "student_eval": [l for l in train[b:] + dev if app(l)]}
  out = {}
  for k, v in parts.items():
    out[k] = os.path.join(out_dir, f"{k}.csv")
    with open(out[k], "wb") as f:
      f.write(b"\n".join(v) + b"\n")
  return out


def avazu_benchmark(workdir: str, data_dir: str, base_teacher_config, budget: Budget,
                    variants: Sequence[str], emit: Callable[[dict], None]) -> list[dict]:
  """The Avazu sample: teacher on the older rows of both domains, students on app traffic."""
  paths = split_avazu(os.path.join(data_dir, "avazu_9k_train.csv"),
                      os.path.join(data_dir, "avazu_9k_dev.csv"), os.path.join(workdir, "data"))
  vocab = 1 << 13
  tdata = dict(kind="avazu", train=paths["teacher"], eval=os.path.join(data_dir, "avazu_9k_dev.csv"),
               vocab_size=vocab, shuffle_buffer=1024, eval_examples=0)
  tcfg = teacher_config(base_teacher_config, tdata, budget.teacher_steps, 256)
  tdir = os.path.join(workdir, "teacher")
  summary = loop.train_and_evaluate(tcfg, tdir)
  teacher = predict.restore_model(tcfg, tdir, budget.batch_size)
  sdata = _cfg(dict(kind="avazu", train=paths["student_train"], eval=paths["student_eval"],
                    vocab_size=vocab, shuffle_buffer=0))
  src_train, src_eval = data_registry.make_sources(sdata)
  sources = teacher_on(src_train, src_eval, teacher, workdir, budget.batch_size)
  n = {k: sum(1 for _ in open(p, "rb")) for k, p in paths.items()}
  emit({"dataset": "avazu", "variant": "teacher", "teacher_eval_auc": summary.get("eval_auc"),
        "teacher_auc_on_student_eval": sources["teacher_auc"], "rows": n,
        "teacher_steps": budget.teacher_steps})
  shared = ("app_id", "app_domain", "app_category", "device_model", "C14", "C17", "C19", "C21")
  return run_variants(src_train.spec, sources, teacher, teacher.setup.mesh, budget, variants,
                      shared, None, emit, "avazu")


def print_row(row: dict) -> None:
  if jax.process_index() == 0:
    print(json.dumps(row, default=float), flush=True)
