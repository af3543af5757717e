"""The student side of knowledge transfer: what is trained, what is frozen, what is shared.

  TransferOptions      which transfer mechanisms a student run uses (static)
  StudentBundle        nnx module {student: Student, adapter: StudentAdapter | None}
  trainable_mask       params pytree of bools: False = frozen (update forced to 0)
  frozen_row_ranges    per embedding buffer, the row ranges of frozen tables
  share_from_teacher   copies teacher tables / dense blocks into a student state
  student_flops        analytic forward FLOPs per example of `gem_jax.models.Student`

Parameter sharing (GEM.md §3.5): student tables and front-end blocks
('dense_tok', 'sparse_proj') start as the teacher's trained values (same
shapes required); with `freeze_shared` they stay bit-identical: their dense
gradients and updates are zeroed, and their embedding rows are restored after
the sparse update (frozen rows only; other tables in the same buffer train).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data.spec import DataSpec
from gem_jax.flops import heads_flops, wukong_stack_flops
from gem_jax.layers.adapter import StudentAdapter
from gem_jax.layers.mlp import mlp_flops
from gem_jax.models.config import GEMConfig
from gem_jax.models.dlrm import feature_order
from gem_jax.models.student import Student

SHAREABLE_BLOCKS = ("dense_tok", "sparse_proj")


@dataclasses.dataclass(frozen=True)
class TransferOptions:
  """Which knowledge-transfer mechanisms a student uses.

  Args:
    distill_weights: per-task weights w_t of the soft-target loss (None: no distillation).
    temperature: distillation temperature T.
    adapter: distil from the Student Adapter's corrected teacher logits.
    adapter_hidden: hidden widths of the adapter's correction MLP.
    teacher_emb: knowledge field fed to the student as extra input tokens (None: off).
    teacher_emb_dim: its width (set from the knowledge index).
    share_tables: student tables initialised from the teacher's.
    share_blocks: student blocks (of SHAREABLE_BLOCKS) initialised from the teacher's.
    freeze_shared: keep shared tables and blocks fixed (bit-identical).
    train_student: False trains only the adapter (every student parameter frozen).
  """
  distill_weights: tuple[float, ...] | None = None
  temperature: float = 1.0
  adapter: bool = False
  adapter_hidden: tuple[int, ...] = (16,)
  teacher_emb: str | None = None
  teacher_emb_dim: int = 0
  share_tables: tuple[str, ...] = ()
  share_blocks: tuple[str, ...] = ()
  freeze_shared: bool = False
  train_student: bool = True

  def __post_init__(self):
    if self.adapter and self.distill_weights is None:
      raise ValueError("adapter=True needs distill_weights: the adapter corrects the teacher "
                       "logits that the student is distilled from")
    if self.temperature <= 0:
      raise ValueError(f"temperature must be > 0, got {self.temperature}")
    bad = set(self.share_blocks) - set(SHAREABLE_BLOCKS)
    if bad:
      raise ValueError(f"share_blocks {sorted(bad)} not in {SHAREABLE_BLOCKS}")
    if self.teacher_emb and self.teacher_emb_dim <= 0:
      raise ValueError(f"teacher_emb={self.teacher_emb!r} needs teacher_emb_dim > 0")
    if not self.train_student and not self.adapter:
      raise ValueError("train_student=False (adapter-only training) needs adapter=True")

  @property
  def uses_teacher_logits(self) -> bool:
    return self.distill_weights is not None


class StudentBundle(nnx.Module):
  """The trained modules of a student run: the student and, optionally, its adapter.

  Call: (inputs) -> student logits (B, T) (the adapter is a training-time module).
  """

  def __init__(self, cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int],
               opts: TransferOptions, *, rngs: nnx.Rngs):
    cfg = dataclasses.replace(cfg, teacher_dim=opts.teacher_emb_dim if opts.teacher_emb else 0)
    self.student = Student(cfg, spec, feature_dims, rngs=rngs)
    self.adapter = (StudentAdapter(len(spec.tasks), spec.n_dense, max(spec.num_domains, 1),
                                   hidden=opts.adapter_hidden, rngs=rngs)
                    if opts.adapter else None)

  def __call__(self, inputs):
    return self.student(inputs)


def _path_names(path) -> tuple[str, ...]:
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def is_trainable(names: Sequence[str], opts: TransferOptions) -> bool:
  """Whether the parameter at `names` (path inside StudentBundle's params) is trained."""
  if names[0] == "adapter":
    return True
  if not opts.train_student:
    return False
  return not (opts.freeze_shared and len(names) > 1 and names[1] in opts.share_blocks)


def trainable_mask(params, opts: TransferOptions):
  """A pytree like `params` (abstract or concrete) with a Python bool per leaf."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: is_trainable(_path_names(path), opts), params)


def apply_mask(tree, mask):
  """Zeros the leaves of `tree` whose mask is False (static bools: no runtime cost)."""
  return jax.tree.map(lambda x, keep: x if keep else jnp.zeros_like(x), tree, mask)


def frozen_row_ranges(plan, tables: Sequence[str]) -> dict[str, tuple[tuple[int, int], ...]]:
  """{buffer: ((start, stop), ...)}: the global buffer rows of frozen `tables`.

  Table-wise buffers pack several tables (table i at owner_i * local_rows +
  offset_i); every other kind holds one table, frozen as a whole.
  """
  out: dict[str, list] = {}
  for t in tables:
    if t not in plan.tables:
      raise KeyError(f"cannot freeze unknown table {t!r}; tables: {sorted(plan.tables)}")
    name = plan.buffer_of[t]
    buf = plan.buffers[name]
    if buf.kind == "table_wise":
      i = buf.tables.index(t)
      start = buf.owners[i] * buf.local_rows + buf.offsets[i]
      out.setdefault(name, []).append((start, start + plan.tables[t].rows))
    else:
      out.setdefault(name, []).append((0, buf.rows))
  return {k: tuple(v) for k, v in out.items()}


def keep_frozen_rows(new_emb: dict, old_emb: dict, ranges: Mapping[str, Sequence]) -> dict:
  """new_emb with the frozen rows (weights and per-row slots) taken from old_emb, bitwise.

  The reference (and benchmark baseline) for `apply_sparse_updates(..., frozen=ranges)`,
  which the transfer step uses: this one selects over every row of the buffers, every
  step. Scalar slots (Adam's step) are kept only where the whole buffer is frozen.
  """
  out = dict(new_emb)
  for name, rr in ranges.items():
    leaves = {}
    for leaf, new in new_emb[name].items():
      old = old_emb[name][leaf]
      if new.ndim == 0:
        whole = any(a == 0 and b >= new_emb[name]["weight"].shape[0] for a, b in rr)
        leaves[leaf] = old if whole else new
        continue
      i = jax.lax.broadcasted_iota(jnp.int32, new.shape[:1], 0)  # (rows,)
      frozen = jnp.zeros(new.shape[:1], bool)
      for a, b in rr:
        frozen = frozen | ((i >= a) & (i < b))
      frozen = frozen.reshape(frozen.shape + (1,) * (new.ndim - 1))
      leaves[leaf] = jnp.where(frozen, old, new)
    out[name] = leaves
  return out


def share_from_teacher(state, student_plan, teacher_params, teacher_canonical_emb: Mapping,
                       opts: TransferOptions):
  """The student state with shared tables and blocks set to the teacher's values.

  Args:
    state: a fresh student TrainState (params = StudentBundle params).
    student_plan: the student's embedding plan.
    teacher_params: the teacher's params (nnx.State of the teacher model).
    teacher_canonical_emb: the teacher's canonical tables ({table: {'weight': ...}}).
    opts: share_tables / share_blocks say what is copied.
  Returns:
    the new state (same shardings; optimizer slots of the copied tables start fresh).
  """
  if opts.share_tables:
    canon = emb_lib.export_state(student_plan, state.emb)
    canon = {t: dict(v) for t, v in canon.items()}
    for t in opts.share_tables:
      if t not in teacher_canonical_emb:
        raise KeyError(f"shared table {t!r} not in the teacher's tables {sorted(teacher_canonical_emb)}")
      w = teacher_canonical_emb[t]["weight"]
      if tuple(w.shape) != tuple(canon[t]["weight"].shape):
        raise ValueError(f"shared table {t!r}: teacher {tuple(w.shape)} vs student "
                         f"{tuple(canon[t]['weight'].shape)} (use the teacher's rows and dim)")
      canon[t]["weight"] = jax.device_put(w, canon[t]["weight"].sharding, may_alias=False)
    state = state.replace(emb=emb_lib.import_state(student_plan, canon))
  if opts.share_blocks:
    params = state.params
    for block in opts.share_blocks:
      mine, theirs = params["student"][block], teacher_params[block]
      shapes = (jax.tree.map(jnp.shape, mine), jax.tree.map(jnp.shape, theirs))
      if jax.tree.structure(mine) != jax.tree.structure(theirs) or shapes[0] != shapes[1]:
        raise ValueError(f"shared block {block!r}: teacher and student shapes differ "
                         f"({shapes[1]} vs {shapes[0]}); use the teacher's d_model and dims")
      # Copies (may_alias=False): the student state is donated to its step, which
      # must not delete the teacher's buffers.
      params["student"][block] = jax.tree.map(
          lambda t, s: jax.device_put(t.astype(s.dtype), s.sharding, may_alias=False),
          theirs, mine)
    state = state.replace(params=params)
  return state


def student_flops(cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int],
                  teacher_dim: int = 0, teacher_tokens: int = 2) -> dict[str, int]:
  """Forward FLOPs per example of `Student` (GEM.md §5 conventions; gathers count 0).

  The teacher embedding input costs only its projection: the embedding itself is
  precomputed knowledge, not a teacher forward at serving time.
  """
  d = cfg.d_model
  pooled, seq = feature_order(spec)
  n_t = teacher_tokens if teacher_dim else 0
  n0 = cfg.n_dense_tokens + len(pooled) + len(seq) + n_t
  out = {
      "dense_tokenizer": mlp_flops(spec.n_dense, tuple(cfg.dense_hidden) + (cfg.n_dense_tokens * d,)),
      "sparse_projector": sum(2 * feature_dims[f] * d for f in pooled if feature_dims[f] != d)
      + sum(2 * feature_dims[f] * d for _, f in seq if feature_dims[f] != d),
      "teacher_projection": 2 * teacher_dim * n_t * d,
      "wukong": wukong_stack_flops(n0, d, cfg.num_blocks, cfg.wukong_nf, cfg.wukong_nl,
                                   cfg.wukong_k, cfg.wukong_mlp, cfg.cross_layer),
      "trunk": mlp_flops(cfg.n_interaction * d, cfg.trunk_hidden),
      "heads": heads_flops(cfg.trunk_hidden[-1], len(spec.tasks), max(spec.num_domains, 1),
                           cfg.head_kind, cfg.head_hidden, cfg.num_experts, cfg.expert_hidden),
  }
  out["total"] = sum(out.values())
  return out


def tree_equal(a: Any, b: Any) -> bool:
  """Bitwise equality of two pytrees of arrays (same structure)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))
