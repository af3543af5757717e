"""A restored model -> a self-contained serving artifact (read by gem_jax/serving/loader.py).

  ART/manifest.json              format + version, spec, features, tables (rows, dim, id
                                 policy, dtype, files, quantization error), inputs, outputs,
                                 functions, checkpoint step, model config (written last)
  ART/score_b.jaxexport          the scoring function, `jax.export` (StableHLO) for a
  ART/score_64.jaxexport         symbolic batch 'b' or for each stated batch size
  ART/params.npz                 dense parameters (and other model variables) by path
  ART/tables/<table>.<leaf>.npy  tables: weight (fp32 | bf16 as uint16 bits) or q + scale
  ART/tables/<table>.map_ids.npy managed tables: the raw id of every row (int64, -1 empty)

The scoring function is the eval forward on one device, over whole tables:

  score(params, tables, batch) -> {'probs': (B, T), 'logits': (B, T)[, 'trunk': (B, H)]}
    rows_f = table[ids_f] (dequantized, in the training storage dtype; -1: zero rows)
    e_f    = sum_i w_i rows_f,i ('sum'), / n_valid ('mean'), or per id ('none')
    logits = model(model_inputs(spec, batch, e))                    the model's forward

Its inputs are the batch contract with ids already through the id policy (int32 rows,
-1 = none) and weights for every feature (the loader fills 1): the policy stays on the
host, in numpy, as in training (gem_jax.embedding.ids). The sharded lookup of training
computes the same pooled sums (fp32), so with fp32 tables the exported logits equal the
eval step's on one device bit for bit, and a partitioned eval step's to the order of its
fp32 reductions (tests/test_serving.py).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data.columnar import spec_to_json
from gem_jax.serving import loader
from gem_jax.serving import quantize
from gem_jax.train import step as step_lib
from gem_jax.train.predict import Model, model_outputs

UNSEEN_IDS = {
    "hash": "every id (seen in training or not) reads row splitmix64(id) mod rows, the row "
            "of the training ids that share its bucket",
    "clip": "ids >= rows read the last row (shared by all of them)",
    "error": "an id >= rows is refused: predict raises ValueError naming the feature and id",
    "managed": "ids in the training map read their rows; ids not in it (never seen, or "
               "evicted) read zero rows, as padding",
}


def _key(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def host_params(model: Model) -> tuple[dict[str, np.ndarray], list[str], object]:
  """({path: array} of the dense parameters and other model variables, their order, treedef)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      (model.state.params, model.state.model_state))
  keys = [_key(p) for p, _ in leaves]
  return {k: np.asarray(v) for k, (_, v) in zip(keys, leaves)}, keys, treedef


def host_tables(model: Model) -> dict[str, np.ndarray]:
  """{table: fp32 weight (rows, D)}: the canonical tables, gathered on the host."""
  canon = emb_lib.export_state(model.setup.plan, model.state.emb)
  return {t: np.asarray(v["weight"], np.float32) for t, v in canon.items()}


def host_maps(model: Model) -> dict[str, np.ndarray]:
  """{managed table: int64 (rows,) raw id of each row, -1 = empty}."""
  canon = emb_lib.export_state(model.setup.plan, model.state.emb)
  return {t: emb_lib.managed.join_ids(np.stack([np.asarray(v["map_hi"]),
                                                np.asarray(v["map_lo"])], -1))
          for t, v in canon.items() if "map_hi" in v}


def input_signature(spec, features: dict, b) -> dict:
  """The scoring function's batch: ShapeDtypeStructs with leading dimension b."""
  sds = jax.ShapeDtypeStruct
  seq = {s.name: {"len": sds((b,), jnp.int32), "action": sds((b, s.max_len), jnp.int32),
                  "surface": sds((b, s.max_len), jnp.int32), "dt": sds((b, s.max_len), jnp.float32)}
         for s in spec.sequences}
  return {"dense": sds((b, spec.n_dense), jnp.float32),
          "ids": {n: sds((b, f.bag), jnp.int32) for n, f in features.items()},
          "weights": {n: sds((b, f.bag), jnp.float32) for n, f in features.items()},
          "seq": seq, "domain": sds((b,), jnp.int32)}


def embeddings(features: dict, tables: dict, batch: dict, table_dtype: str,
               compute: dict | None = None) -> dict:
  """{feature: (B, D) pooled | (B, L, D) per id} from whole tables (one device), pooled in
  `compute[table]` (the training storage dtype, as the sharded lookup pools; default fp32)."""
  out = {}
  for name, f in features.items():
    dt = (compute or {}).get(f.table, jnp.float32)
    ids = batch["ids"][name]                                             # (B, bag)
    w = jnp.where(ids >= 0, batch["weights"][name].astype(jnp.float32), 0.0).astype(dt)
    rows = quantize.gather(tables[f.table], ids, table_dtype).astype(dt)  # (B, bag, D)
    if f.pooling == "none":
      out[name] = rows * w[..., None]
      continue
    e = jnp.einsum("bl,bld->bd", w, rows)                               # (B, D)
    if f.pooling == "mean":
      e = e / jnp.maximum(jnp.sum(ids >= 0, axis=1).astype(jnp.float32), 1.0)[:, None].astype(dt)
    out[name] = e
  return out


def scoring_fn(model: Model, keys: Sequence[str], treedef, table_dtype: str, trunk: bool):
  """score(params {path: array}, tables {table: {leaf: array}}, batch) -> outputs (dict)."""
  s = model.setup
  graphdef, spec, features = s.eval_cfg.graphdef, s.spec, dict(s.plan.features)
  compute = {n: t.dtype for n, t in s.plan.tables.items()}
  fields = ("trunk",) if trunk else ()

  def score(params, tables, batch):
    p, rest = jax.tree_util.tree_unflatten(treedef, [params[k] for k in keys])
    net = nnx.merge(graphdef, p, rest)
    emb = embeddings(features, tables, batch, table_dtype, compute)
    out = model_outputs(net, step_lib.model_inputs(spec, batch, emb), fields)
    out["probs"] = jax.nn.sigmoid(out["logits"])
    return out
  return score


def _signature_json(tree) -> list[dict]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [{"path": _key(p).replace(".", "/"),
           "shape": [d if isinstance(d, int) else str(d) for d in x.shape],
           "dtype": str(np.dtype(x.dtype))} for p, x in leaves]


def export_artifact(model: Model, out: str, *, batch_sizes: Sequence[int] | None = None,
                    table_dtype: str = "float32", trunk: bool = False,
                    platforms: Sequence[str] | None = None, config=None,
                    overwrite: bool = False) -> dict:
  """Writes the artifact of `model` to `out` (module docstring); returns its manifest.

  Args:
    model: from `gem_jax.train.predict.restore_model` (any mesh; one process).
    batch_sizes: export for these batch sizes; None: one function of a symbolic batch.
    table_dtype: 'float32', 'bfloat16' or 'int8' (gem_jax/serving/quantize.py).
    trunk: also return the trunk embedding.
    platforms: lowering platforms (default: this backend), e.g. ('cpu', 'cuda').
    config: the run config, recorded in the manifest.
    overwrite: replace an existing `out`.
  """
  if jax.process_count() > 1:
    raise ValueError("export from one process (it restores onto any device count)")
  if table_dtype not in quantize.DTYPES:
    raise ValueError(f"table dtype {table_dtype!r}: expected one of {quantize.DTYPES}")
  if os.path.exists(out) and os.listdir(out):
    if not overwrite:
      raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    shutil.rmtree(out)
  s = model.setup
  features = dict(s.plan.features)
  params, keys, treedef = host_params(model)
  stored, table_meta = {}, {}
  os.makedirs(os.path.join(out, "tables"), exist_ok=True)
  maps = host_maps(model)
  for name, w in host_tables(model).items():
    arrays, err = quantize.quantize(w, table_dtype)
    t = s.plan.tables[name]
    files = {}
    for leaf, x in arrays.items():
      files[leaf] = f"tables/{name}.{leaf}.npy"
      np.save(os.path.join(out, files[leaf]),
              x.view(np.uint16) if x.dtype == jnp.bfloat16 else x)
    stored[name] = arrays
    table_meta[name] = {"rows": t.rows, "dim": t.dim, "id_policy": t.id_policy,
                        "trained_dtype": str(np.dtype(t.dtype)),
                        "unseen_ids": UNSEEN_IDS[t.id_policy], "dtype": table_dtype,
                        "files": files, "error": err,
                        "bytes": quantize.bytes_per_row(table_dtype, t.dim) * t.rows}
    if name in maps:   # raw id of every row (-1: empty): the loader maps ids as training did
      table_meta[name]["map"] = f"tables/{name}.map_ids.npy"
      np.save(os.path.join(out, table_meta[name]["map"]), maps[name])
  np.savez(os.path.join(out, "params.npz"), **params)

  fn = jax.jit(scoring_fn(model, keys, treedef, table_dtype, trunk))
  p_sig = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}
  t_sig = {t: {leaf: jax.ShapeDtypeStruct(x.shape, x.dtype) for leaf, x in a.items()}
           for t, a in stored.items()}
  sizes = [None] if batch_sizes is None else sorted({int(b) for b in batch_sizes})
  symbolic = jax.export.symbolic_shape("b")[0]
  functions = {}
  for size in sizes:
    sig = input_signature(s.spec, features, symbolic if size is None else size)
    exp = jax.export.export(fn, platforms=tuple(platforms) if platforms else None)(
        p_sig, t_sig, sig)
    name = "b" if size is None else str(size)
    functions[name] = f"score_{name}.jaxexport"
    with open(os.path.join(out, functions[name]), "wb") as f:
      f.write(exp.serialize())

  manifest = {
      "format": loader.FORMAT, "format_version": loader.FORMAT_VERSION,
      "jax_version": jax.__version__, "platforms": list(exp.platforms),
      "checkpoint_step": model.step,
      "model": config.model.to_dict() if config is not None else None,
      "spec": spec_to_json(s.spec),
      "features": {n: {"table": f.table, "bag": f.bag, "pooling": f.pooling}
                   for n, f in features.items()},
      "tables": table_meta, "table_dtype": table_dtype,
      "inputs": _signature_json(input_signature(s.spec, features, symbolic)),
      "outputs": sorted(exp.out_tree.unflatten(exp.out_avals)), "functions": functions,
      "batch_sizes": "symbolic" if batch_sizes is None else sizes,
      "params": "params.npz",
  }
  tmp = os.path.join(out, loader.MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(out, loader.MANIFEST))
  return manifest
