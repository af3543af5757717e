"""Config -> the objects of a run: one way to build it, for every entry point.

  tables, features = embedding_configs(spec, config.embedding, shared)
  plan = make_plan(spec, config.embedding, mesh, batch_size, shared)
  model_fn = model_factory(config.model, spec, feature_dims)   # MODELS: class + FLOPs
  steps = resolve_steps(config, train_src)  # train.steps, or train.epochs passes
  s = setup(config)                        # everything but the arrays (a `Setup`, with s.steps)
  state, data_position, step = restore_or_init(s, ckpt, seed)
  ckpt.save(step, checkpoint_tree(state, s.plan), ...)

Used by the trainer (loop.py), evaluation (evaluate.py), the benchmark and the
scale projection (bench/), knowledge generation and the student run (transfer/).
Every config problem is a `validate.ConfigError`, raised before anything compiles.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax import flops as flops_lib
from gem_jax.data import pipeline
from gem_jax.data import registry as data_registry
from gem_jax.data.columnar import DatasetError
from gem_jax.data.source import LineSource
from gem_jax.data.spec import DataSpec
from gem_jax.models import config as model_config_lib
from gem_jax.parallel import distributed as dist
from gem_jax.parallel import sharding as shd
from gem_jax.parallel.mesh import make_mesh
from gem_jax.train import metrics as metrics_lib
from gem_jax.train import nonfinite
from gem_jax.train import optim
from gem_jax.train import packing as packing_lib
from gem_jax.train import report
from gem_jax.train import state as state_lib
from gem_jax.train import step as step_lib
from gem_jax.train import validate
from gem_jax.train.validate import ConfigError


# ------------------------------------------------------------------ tables --

def embedding_configs(spec: DataSpec, emb_cfg, shared: dict | None = None) -> tuple[list, list]:
  """One table per sparse feature (rows = its vocab, width = emb_cfg.dim, unless
  `emb_cfg.per_table` says otherwise: `per_table_settings`).

  Pooled features are sum-pooled bags; sequence item features are looked up
  per event (pooling 'none', bag = the stream length). `shared` maps a feature
  to another feature whose table it reads (e.g. a history of ad categories
  and the candidate's category share one table, as the source declares with
  `shared_vocab`).
  """
  shared = dict(shared or {})
  seq_len = {f: s.max_len for s in spec.sequences for f in s.item_features}
  own = per_table_settings(emb_cfg, [f.name for f in spec.sparse if
                                     shared.get(f.name, f.name) == f.name])
  tables, features = [], []
  for f in spec.sparse:
    table = shared.get(f.name, f.name)
    if table == f.name:
      o = own.get(f.name, {})
      acc0 = o.get("initial_accumulator", _initial_accumulator(emb_cfg))
      opt = (emb_lib.SparseOptimizerConfig(kind=o.get("optimizer", emb_cfg.optimizer),
                                           lr=float(o.get("lr", emb_cfg.lr)),
                                           initial_accumulator=float(acc0))
             if o.keys() & {"optimizer", "lr", "initial_accumulator"} else None)
      policy = o.get("id_policy", emb_cfg.id_policy)
      rows = int(o.get("rows", f.vocab))
      managed = {}
      if policy == "managed":   # rows rounded up to whole probe windows
        managed = {k: o[k] for k in ("eviction", "ttl_steps", "probe") if k in o}
        probe = managed.get("probe", emb_lib.TableConfig.probe)
        rows = -(-rows // probe) * probe
      sharding = "auto" if policy == "managed" else emb_cfg.sharding
      try:
        tables.append(emb_lib.TableConfig(
            f.name, rows=rows, dim=int(o.get("dim", emb_cfg.dim)),
            dtype=jnp.dtype(o.get("dtype", "float32")), sharding=sharding, id_policy=policy,
            vocab=f.vocab, optimizer=opt, **managed))
      except ValueError as e:
        raise ConfigError(f"embedding.per_table: {e}") from None
    if f.name in seq_len:
      features.append(emb_lib.FeatureConfig(f.name, table, bag=seq_len[f.name], pooling="none"))
    else:
      features.append(emb_lib.FeatureConfig(f.name, table, bag=f.bag, pooling="sum"))
  return tables, features


PER_TABLE_KEYS = {"dim": int, "dtype": str, "optimizer": str, "lr": float, "rows": int,
                  "id_policy": str, "eviction": str, "ttl_steps": int, "probe": int,
                  "initial_accumulator": float}
TABLE_DTYPES = ("float32", "bfloat16")


def per_table_settings(emb_cfg, tables: list[str]) -> dict[str, dict]:
  """`embedding.per_table` -> {table: {dim, dtype, optimizer, lr}} (the keys it sets).

  Syntax: rules `PATTERNS: key=value, ...` separated by ';', PATTERNS '|'-separated
  globs over the table (feature) names; later rules win. Example:
  'C1|C2: dim=64, optimizer=adam, lr=0.001; hist_*: dtype=bfloat16'. Keys: dim, dtype
  (float32 | bfloat16: storage; optimizer state stays fp32), optimizer
  (rowwise_adagrad | sgd | adam), lr, initial_accumulator (rowwise_adagrad's starting
  sum of g^2, >= 0), rows (default: the feature's vocab), id_policy
  (hash | error | clip | managed) and for managed tables eviction (lru | lfu), ttl_steps,
  probe (rows rounded up to whole probe windows), e.g. 'user_id: id_policy=managed,
  rows=65536, eviction=lfu, ttl_steps=1000'. A pattern matching no table, an unknown
  key or value: ConfigError.
  """
  spec = (getattr(emb_cfg, "per_table", "") or "").strip()
  out: dict[str, dict] = {}
  for rule in filter(None, (r.strip() for r in spec.split(";"))):
    if ":" not in rule:
      raise ConfigError(f"embedding.per_table: rule {rule!r} is not 'PATTERNS: key=value, ...'")
    pats, body = rule.split(":", 1)
    values = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
      key, _, val = item.partition("=")
      key, val = key.strip(), val.strip()
      if key not in PER_TABLE_KEYS or not val:
        raise ConfigError(f"embedding.per_table: {item!r} in rule {rule!r}: keys are "
                          f"{sorted(PER_TABLE_KEYS)} as key=value")
      try:
        values[key] = PER_TABLE_KEYS[key](val)
      except ValueError:
        raise ConfigError(f"embedding.per_table: {key}={val!r} is not a "
                          f"{PER_TABLE_KEYS[key].__name__}") from None
    if values.get("dtype", "float32") not in TABLE_DTYPES:
      raise ConfigError(f"embedding.per_table: dtype={values['dtype']!r} not in {TABLE_DTYPES}")
    if values.get("optimizer", "sgd") not in emb_lib.config.OPTIMIZERS:
      raise ConfigError(f"embedding.per_table: optimizer={values['optimizer']!r} not in "
                        f"{emb_lib.config.OPTIMIZERS}")
    if values.get("id_policy", "hash") not in emb_lib.config.ID_POLICIES:
      raise ConfigError(f"embedding.per_table: id_policy={values['id_policy']!r} not in "
                        f"{emb_lib.config.ID_POLICIES}")
    if values.get("eviction", "lru") not in emb_lib.config.EVICTIONS:
      raise ConfigError(f"embedding.per_table: eviction={values['eviction']!r} not in "
                        f"{emb_lib.config.EVICTIONS}")
    if (values.get("rows", 1) <= 0 or values.get("probe", 1) <= 0
        or values.get("ttl_steps", 0) < 0):
      raise ConfigError(f"embedding.per_table: rule {rule!r}: rows and probe must be positive, "
                        "ttl_steps >= 0")
    if values.get("dim", 1) <= 0 or values.get("lr", 1.0) <= 0:
      raise ConfigError(f"embedding.per_table: rule {rule!r}: dim and lr must be positive")
    if values.get("initial_accumulator", 0.0) < 0:
      raise ConfigError(f"embedding.per_table: rule {rule!r}: initial_accumulator must be >= 0")
    for pat in (p.strip() for p in pats.split("|")):
      hit = fnmatch.filter(tables, pat)
      if not hit:
        raise ConfigError(f"embedding.per_table: pattern {pat!r} matches no table; tables: "
                          f"{tables}")
      for t in hit:
        out.setdefault(t, {}).update(values)
  return out


def _initial_accumulator(emb_cfg) -> float:
  """`embedding.initial_accumulator` (0 where the config has none); negative: ConfigError."""
  acc0 = float(getattr(emb_cfg, "initial_accumulator", 0.0) or 0.0)
  if acc0 < 0:
    raise ConfigError(f"config.embedding.initial_accumulator={acc0} must be >= 0")
  return acc0


def sparse_optimizer(emb_cfg) -> emb_lib.SparseOptimizerConfig:
  """The plan's table optimizer: embedding.optimizer, lr and initial_accumulator."""
  return emb_lib.SparseOptimizerConfig(kind=emb_cfg.optimizer, lr=emb_cfg.lr,
                                       initial_accumulator=_initial_accumulator(emb_cfg))


def table_widths(plan) -> dict[str, int]:
  """{feature: D_f, the width of the table it reads} (`embedding.per_table` dims included)."""
  return {f: plan.tables[c.table].dim for f, c in plan.features.items()}


def make_plan(spec: DataSpec, emb_cfg, mesh, batch_size: int, shared: dict | None = None, *,
              replica_sync: str | None = None, id_stats: dict | None = None,
              rw_exchange: str | None = None):
  """The embedding plan (any mesh, an AbstractMesh too); over the memory budget: ConfigError.

  `replica_sync`, `rw_exchange` None: the config's `embedding.replica_sync`,
  `embedding.rw_exchange` (default 'auto' each);
  `id_stats`: {feature: emb_lib.IdStats} (`sample_id_stats`) for the planner.
  """
  tables, features = embedding_configs(spec, emb_cfg, shared)
  budget = emb_cfg.get("memory_budget_gb")
  try:
    return emb_lib.plan_embeddings(
        tables, features, mesh, batch_size=batch_size, optimizer=sparse_optimizer(emb_cfg),
        memory_budget_bytes=int(budget * 2**30) if budget else None,
        replica_sync=replica_sync or emb_cfg.get("replica_sync", "auto"), id_stats=id_stats,
        rw_exchange=rw_exchange or emb_cfg.get("rw_exchange", "auto"))
  except ValueError as e:
    raise ConfigError(f"embedding plan: {e}") from None


def sample_id_stats(config, train_src, plan) -> dict | None:
  """Id statistics of the first `embedding.id_stats_batches` global train batches, read
  alike on every process (so every process plans the same), when `plan` has row-wise
  units (their all_to_all capacity is what the statistics size); else None."""
  n = int(config.embedding.get("id_stats_batches", 0))
  if n <= 0 or not any(u.kind == "row_wise" for u in plan.units.values()):
    return None
  it = train_src.batches(config.data.batch_size, seed=config.seed, repeat=True)
  try:
    sample = [b["ids"] for b in pipeline.take(it, n)]
  finally:
    getattr(it, "close", lambda: None)()
  tables, features = list(plan.tables.values()), list(plan.features.values())
  return emb_lib.id_stats(tables, features, sample, num_devices=plan.mesh.devices.size,
                          num_shards=plan.num_shards)


def sources(config) -> tuple[Any, Any, dict | None]:
  """(train source, eval source, shared tables or None) of the `data` block."""
  try:
    train_src, eval_src = data_registry.make_sources(config.data)
  except (FileNotFoundError, OSError, DatasetError) as e:
    raise ConfigError(f"config.data ({config.data.kind}): {e}") from None
  shared = getattr(train_src, "shared_vocab", None) if config.embedding.share_tables else None
  return train_src, eval_src, shared


def resolve_steps(config, train_src) -> int:
  """The run's train steps: `train.steps` if > 0, else ceil(train.epochs * rows / batch_size).

  rows: `train_src.num_rows()` (file sources: their line count), else
  `data.train_examples` (generated data); neither: ConfigError. The one place the
  rule of configs/base.py is applied; the result is logged.
  """
  t, batch = config.train, config.data.batch_size
  epochs = float(t.epochs)
  if t.steps > 0:
    if epochs > 0:
      logging.info("train.steps=%d sets the run's length (train.epochs=%g applies only with "
                   "train.steps=0)", t.steps, epochs)
    return int(t.steps)
  count = getattr(train_src, "num_rows", None)
  rows = count() if count is not None else None
  if rows is None:
    rows = config.data.train_examples or None
  if rows is None:
    describe = getattr(train_src, "describe", lambda: type(train_src).__name__)
    raise ConfigError(f"config.train.epochs={epochs:g} needs the train rows, but "
                      f"{describe()} cannot count them (no num_rows(), no "
                      "config.data.train_examples): set config.train.steps instead")
  if rows < 1:
    raise ConfigError(f"config.train.epochs={epochs:g}: config.data.train has no rows")
  steps = max(1, math.ceil(epochs * rows / batch))
  if jax.process_index() == 0:
    lines = isinstance(train_src, LineSource)   # bad rows are skipped when read: a pass is
    logging.info("%g epoch%s of %s%s rows = %s steps of %d%s", epochs,  # over the good ones
                 "" if epochs == 1 else "s", "~" if lines else "", f"{rows:,}",
                 f"{steps:,}", batch, " (the files' line count; bad and blank lines, which "
                 "the reader skips, included)" if lines else "")
  return steps


# ------------------------------------------------------------------ models --

class ModelEntry(NamedTuple):
  """A model name of `config.model.name`: its class, its forward FLOPs per example and the
  table learning rate it trains best with (`config.embedding.lr` unset)."""
  module: str          # imported when the model is built
  cls: str
  flops: Callable[[Any, DataSpec, dict], float]   # (GEMConfig, spec, feature dims) -> FLOPs
  table_lr: float = 0.05


def _gem_flops(cfg, spec, dims) -> float:
  return flops_lib.gem_flops(cfg, spec, dims)["total"]


def _dlrm_flops(interaction: str) -> Callable:
  return lambda cfg, spec, dims: flops_lib.dlrm_flops(cfg, spec, dims, interaction)["total"]


def _linear_flops(cfg, spec, dims) -> float:
  del cfg
  from gem_jax.models import linear  # pylint: disable=import-outside-toplevel
  return linear.linear_flops(spec, dims)


def _fm_flops(name: str) -> Callable:
  """FLOPs of gem_jax.models.fm's `name` ('fm_flops' or 'fwfm_flops'), imported when called."""
  def flops(cfg, spec, dims) -> float:
    del cfg
    from gem_jax.models import fm  # pylint: disable=import-outside-toplevel
    return getattr(fm, name)(spec, dims)
  return flops


# table_lr: the best row-wise Adagrad lr of {0.05, 0.1, 0.15, 0.2, 0.4} on planted pair data
# (320k rows of the quality benchmark's seed 0, one pass; docs/RESULTS.md "Table learning rates").
MODELS: dict[str, ModelEntry] = {
    "gem": ModelEntry("gem_jax.models.gem", "GEM", _gem_flops, table_lr=0.2),
    "dlrm": ModelEntry("gem_jax.models.dlrm", "DLRM", _dlrm_flops("dot"), table_lr=0.15),
    "dcnv2": ModelEntry("gem_jax.models.dlrm", "DCNv2", _dlrm_flops("dcn"), table_lr=0.2),
    "lr": ModelEntry("gem_jax.models.linear", "LinearModel", _linear_flops, table_lr=0.05),
    "fm": ModelEntry("gem_jax.models.fm", "FM", _fm_flops("fm_flops"), table_lr=0.05),
    "fwfm": ModelEntry("gem_jax.models.fm", "FwFM", _fm_flops("fwfm_flops"), table_lr=0.2),
}


def register_model(name: str, module: str, cls: str, flops: Callable,
                   table_lr: float = 0.05) -> None:
  """Adds a model name (e.g. an ablation defined outside the package, scripts/results.sh)."""
  MODELS[name] = ModelEntry(module, cls, flops, table_lr)


def resolve_table_lr(config) -> float:
  """Sets an unset `config.embedding.lr` (None) to the model's row-wise Adagrad `table_lr`.

  Returns the lr. The models' values were chosen on planted data (docs/RESULTS.md,
  "Table learning rates"); other table optimizers need an explicit lr.
  """
  if config.embedding.lr is None:
    if config.embedding.optimizer != "rowwise_adagrad":
      raise ConfigError(f"config.embedding.lr is unset: set it for "
                        f"embedding.optimizer={config.embedding.optimizer!r} (models carry a "
                        "default for rowwise_adagrad only)")
    config.embedding.lr = model_entry(config.model.name).table_lr
  return config.embedding.lr


def model_entry(name: str) -> ModelEntry:
  if name not in MODELS:
    raise ConfigError(f"config.model.name={name!r}: expected one of {sorted(MODELS)}")
  return MODELS[name]


def model_config(model_cfg):
  """The GEMConfig of a `model` block: preset, then the block's dtype/fp8/remat, then overrides.

  dtype defaults to float32; fp8 and remat override the preset only where the
  block sets them (remat None, '' or 'none' = no rematerialisation).
  """
  overrides = {k: tuple(v) if isinstance(v, list) else v
               for k, v in model_cfg.get("overrides", {}).items()}
  kw = dict(dtype=model_cfg.get("dtype", "float32"))
  if "fp8" in model_cfg:
    kw["fp8"] = model_cfg.fp8
  if "remat" in model_cfg:
    kw["remat"] = None if model_cfg.remat in (None, "", "none") else model_cfg.remat
  try:
    return model_config_lib.get_config(model_cfg.preset, **kw, **overrides)
  except (KeyError, TypeError) as e:
    raise ConfigError(f"config.model (preset {model_cfg.preset!r}, overrides "
                      f"{sorted(overrides)}): {e}") from None


def packing_fit(config, spec: DataSpec) -> packing_lib.Fit | None:
  """The host-side check of GEM's packed histories (gem_jax/train/packing.py), or None."""
  if config.model.name != "gem":
    return None
  return packing_lib.Fit.from_config(model_config(config.model), spec, config.train.grad_accum)


def padded_model(model_cfg):
  """The `model` block with packed histories off (seq_pack_tokens = 0)."""
  out = model_cfg.copy_and_resolve_references()
  with out.unlocked():
    out.overrides = dict(out.get("overrides", {}), seq_pack_tokens=0, seq_pack_rows=0)
  return out


def model_factory(model_cfg, spec: DataSpec, feature_dims: dict) -> Callable[[nnx.Rngs], nnx.Module]:
  """rngs -> model, from the `model` block (name, preset, overrides, dtype, fp8, remat)."""
  entry = model_entry(model_cfg.name)
  cfg = model_config(model_cfg)
  cls = getattr(importlib.import_module(entry.module), entry.cls)
  return lambda rngs: cls(cfg, spec, feature_dims, rngs=rngs)


def train_flops_per_example(model_cfg, spec: DataSpec, feature_dims: dict,
                            lengths: dict | None = None) -> float:
  """Analytic training FLOPs per example: 3 x the model entry's forward count
  (embedding gathers count 0). Sequences at their padded lengths, or for GEM with
  lengths={stream: (N,) real lengths} at those (useful FLOPs, `flops.gem_flops`)."""
  if lengths is not None and model_cfg.name == "gem":
    fwd = flops_lib.gem_flops(model_config(model_cfg), spec, feature_dims, lengths)["total"]
  else:
    fwd = model_entry(model_cfg.name).flops(model_config(model_cfg), spec, feature_dims)
  return float(flops_lib.train_flops(fwd))


def xla_flops_per_example(compiled, batch_size: int) -> float | None:
  """FLOPs per example from XLA's cost analysis of the compiled (per-device) step
  (logged next to the analytic count as a cross-check; it includes the optimizer,
  loss and exchange work the analytic count leaves out)."""
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) * jax.device_count() / batch_size
  except (KeyError, TypeError, IndexError, AttributeError):
    return None


# ------------------------------------------------------- optimizer + state --

class StateParts(NamedTuple):
  """The optimizers and the abstract state of a model on a plan (no arrays)."""
  tx: Any
  schedule: Callable
  sparse_lr: Callable
  abstract: state_lib.TrainState
  shardings: state_lib.TrainState
  acc_fn: Callable
  emb_init: Callable
  graphdef: Any


def state_parts(model_fn: Callable, plan, spec: DataSpec, mesh, optim_cfg, emb_cfg, steps: int,
                *, skip_counter: bool = True) -> StateParts:
  """Dense + sparse optimizers (lr schedules over `steps`), abstract state and its shardings.

  `skip_counter`: the dense optimizer counts the steps skipped for non-finite
  values (checkpointed; the trainer's guard reads it).
  """
  tx, schedule = optim.optimizer_from_config(optim_cfg, steps)
  if skip_counter:
    tx = nonfinite.with_skip_counter(tx)
  sparse_lr = optim.sparse_lr_schedule(emb_cfg.lr, emb_cfg.get("warmup_steps", 0))
  n_tasks, n_domains = len(spec.tasks), spec.num_domains
  acc_fn = lambda: metrics_lib.init_accumulators(n_tasks, n_domains)  # noqa: E731
  emb_init = lambda key: emb_lib.init_embedding_state(plan, key)  # noqa: E731
  abstract, shardings = state_lib.abstract_train_state(model_fn, tx, plan, emb_init, acc_fn, mesh)
  return StateParts(tx, schedule, sparse_lr, abstract, shardings, acc_fn, emb_init,
                    state_lib.model_graphdef(model_fn))


def init_state(run, seed: int) -> state_lib.TrainState:
  """A fresh state in its shardings (`run`: a Setup or a transfer StudentRun: anything
  with model_fn, tx, emb_init, acc_fn and shardings)."""
  return state_lib.init_train_state(jax.random.key(seed), run.model_fn, run.tx, run.emb_init,
                                    run.acc_fn, run.shardings)


# ----------------------------------------------------------------- batches --

def host_batch(plan, batch: dict, collisions: report.IdCollisions | None = None) -> dict:
  """Host-side preparation of this process's rows: ids through the tables' id policy
  (-> int32 in range); with `collisions`, the batch's id collisions are counted into it."""
  batch = dict(batch)
  raw = batch["ids"]
  batch["ids"] = emb_lib.prepare_ids(plan, raw, process_index=jax.process_index(),
                                     process_count=jax.process_count())
  if collisions is not None:
    collisions.add(emb_lib.table_collisions(plan, raw, batch["ids"]))
  return batch


def device_putter(plan, mesh, collisions: report.IdCollisions | None = None):
  """Host batch (this process's rows) -> global device batch split over the mesh."""
  ids_sh = plan.ids_shardings()

  def put(batch):
    batch = host_batch(plan, batch, collisions)
    return pipeline.global_batch(batch, shd.batch_shardings(batch, mesh, ids_sh))
  return put


# ------------------------------------------------------------------- setup --

class Setup(NamedTuple):
  """What a run is made of (built once by `setup`; plain values, no behaviour)."""
  mesh: Any
  spec: DataSpec
  train_src: Any
  eval_src: Any
  plan: Any
  eval_plan: Any
  model_fn: Callable
  feature_dims: dict
  tx: Any
  step_cfg: step_lib.StepConfig
  eval_cfg: step_lib.StepConfig
  abstract: state_lib.TrainState
  shardings: state_lib.TrainState
  acc_fn: Callable
  emb_init: Callable
  steps: int                 # train steps (resolve_steps: train.steps or train.epochs)


def grad_reduce_dtype(config):
  """`config.train.grad_reduce_dtype` as the step takes it: None for fp32 (checked by
  `validate.check_config`)."""
  name = config.train.get("grad_reduce_dtype", "float32")
  return None if name == "float32" else jnp.dtype(name)


def setup(config) -> Setup:
  """Validates `config` and builds everything up to (not including) the arrays.

  Every config error surfaces here, before anything is compiled or allocated.
  """
  mesh = make_mesh(validate.check_config(config, jax.device_count()))
  resolve_table_lr(config)
  train_src, eval_src, shared = sources(config)
  steps = resolve_steps(config, train_src)
  spec = train_src.spec
  validate.check_embedding(spec, config.embedding, shared)
  plan = make_plan(spec, config.embedding, mesh, config.data.batch_size, shared)
  stats = sample_id_stats(config, train_src, plan)
  if stats is not None:
    plan = make_plan(spec, config.embedding, mesh, config.data.batch_size, shared, id_stats=stats)
  eval_plan = plan.with_batch_size(config.data.eval_batch_size)  # the train placement
  feature_dims = table_widths(plan)
  model_fn = model_factory(config.model, spec, feature_dims)
  p = state_parts(model_fn, plan, spec, mesh, config.optim, config.embedding, steps)
  step_cfg = step_lib.StepConfig(p.graphdef, plan, p.tx, p.schedule, p.sparse_lr, spec,
                                 config.train.grad_accum, grad_reduce_dtype(config))
  eval_cfg = dataclasses.replace(step_cfg, plan=eval_plan, grad_accum=1)
  if packing_fit(config, spec) is not None:
    # Evaluation, prediction and export run the padded twin (same parameters): exact for
    # any batch; training steps packed where a batch fits (gem_jax/train/packing.py).
    eval_cfg = dataclasses.replace(eval_cfg, graphdef=state_lib.model_graphdef(
        model_factory(padded_model(config.model), spec, feature_dims)))
  return Setup(mesh, spec, train_src, eval_src, plan, eval_plan, model_fn, feature_dims, p.tx,
               step_cfg, eval_cfg, p.abstract, p.shardings, p.acc_fn, p.emb_init, steps)


# ------------------------------------------------------------- checkpoints --

def checkpoint_tree(state: state_lib.TrainState, plan) -> state_lib.TrainState:
  """The saved form: embedding state as unpadded canonical arrays (any mesh can restore).

  Every leaf handed to the asynchronous save is a fresh copy: the next step donates
  the live state, and on CPU the save's host view of a buffer can be the buffer itself.
  """
  fresh = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x,
                       state.replace(emb=None))
  return fresh.replace(emb=emb_lib.export_state(plan, state.emb))


def checkpoint_abstract(abstract: state_lib.TrainState, plan) -> state_lib.TrainState:
  """Abstract `checkpoint_tree` on this plan's mesh (canonical tables as the plan lays them out)."""
  canon = jax.eval_shape(lambda e: emb_lib.export_state(plan, e), abstract.emb)
  canon = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                       canon, plan.canonical_shardings())
  return abstract.replace(emb=canon)


def restore(s, ckpt, step: int | None = None):
  """(state laid out for `s.plan`, the restored checkpoint) of the latest (or `step`)
  checkpoint of `ckpt`, or (None, None) if it holds none."""
  restored = ckpt.restore(checkpoint_abstract(s.abstract, s.plan), step=step)
  if restored is None:
    return None, None
  return restored.state.replace(emb=emb_lib.import_state(s.plan, restored.state.emb)), restored


def restore_or_init(s: Setup, ckpt, seed: int, *, saved: dict | None = None):
  """(state, train data position or None, restored step or None).

  `saved`: a dict that receives the restored checkpoint's other data entries (the
  loop's record of its evaluations, 'evals'); left as it is on a fresh start.
  """
  state, restored = restore(s, ckpt)
  if restored is None:
    return init_state(s, seed), None, None
  data = restored.data_state or {}
  if saved is not None:
    saved.update({k: v for k, v in data.items() if k != "train"})
  return state, dist.own_data_position(data.get("train")), restored.step
