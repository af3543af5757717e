"""Knowledge transfer: generated knowledge == the teacher's direct forward, exact knowledge
reading (resume, mismatch detection), frozen shared tables/blocks stay bit-identical,
adapter-only training updates only the adapter, the transfer loss formula."""
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train import setup as setup_lib
from gem_jax.train.step import model_inputs
from gem_jax.train import predict
from gem_jax.transfer import generate, losses
from gem_jax.transfer import knowledge as kn
from gem_jax.transfer import train as ttrain
from gem_jax.transfer.planted import PlantedSource
from gem_jax.transfer.student import TransferOptions, tree_equal

B = 32
CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "transfer_teacher_planted.py")


def _teacher_config():
  c = ttrain._load_config(CONFIG)  # pylint: disable=protected-access
  c.mesh = (2, 2)
  c.data.batch_size = c.data.eval_batch_size = B
  return c


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
  """A GEM teacher checkpoint written by the trainer's checkpoint code, restored on 2x4."""
  wd = str(tmp_path_factory.mktemp("teacher"))
  cfg = _teacher_config()
  s = setup_lib.setup(cfg)
  state, _, _ = setup_lib.restore_or_init(s, ckpt_lib.CheckpointManager(
      os.path.join(wd, "checkpoints"), save_every=None, keep=1), seed=3)
  with ckpt_lib.CheckpointManager(os.path.join(wd, "checkpoints"), save_every=None,
                                  keep=1) as ckpt:
    ckpt.save(5, setup_lib.checkpoint_tree(state, s.plan), config=cfg, force=True)
  return predict.restore_model(cfg, wd, B)


@pytest.fixture(scope="module")
def knowledge(teacher, tmp_path_factory):
  """Knowledge of 80 student rows (2.5 batches: the last one padded), 48-row shards."""
  d = str(tmp_path_factory.mktemp("knowledge"))
  src = PlantedSource("student", "train", num_examples=80)
  index = generate.generate_knowledge(teacher, src, d, batch_size=B, fields=("trunk",
                                      "seq_summary"), rows_per_shard=48)
  return src, d, index


def _reference_forward(teacher, batch):
  """The teacher on one device: numpy table lookups + the merged model, no sharding."""
  s = teacher.setup
  canon = jax.tree.map(np.asarray, emb_lib.export_state(s.plan, teacher.state.emb))
  emb = {}
  for f, fc in s.plan.features.items():
    t = s.plan.tables[fc.table]
    ids = emb_lib.apply_id_policy(batch["ids"][f], t.rows, t.id_policy, f, t.name)
    w = canon[fc.table]["weight"]
    rows = np.where(ids[..., None] >= 0, w[np.maximum(ids, 0)], 0.0)  # (B, bag, D)
    emb[f] = rows if fc.pooling == "none" else rows.sum(1)
  model = nnx.merge(s.step_cfg.graphdef, jax.device_get(teacher.state.params),
                    jax.device_get(teacher.state.model_state))
  logits, aux = model(model_inputs(s.spec, batch, emb), return_aux=True)
  return np.asarray(logits), np.asarray(aux["trunk"]), np.asarray(aux["seq_summary"])


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_generated_knowledge_matches_teacher_forward(teacher, knowledge):
  src, d, index = knowledge
  assert index["num_batches"] == 3 and index["shards"] == [[48, 48]]
  assert index["fields"] == {"logits": [2], "trunk": [32], "seq_summary": [80], "valid": [],
                             "fingerprint": []}
  got = list(kn.KnowledgeSource(src, d).batches(B, repeat=False))
  assert len(got) == 3
  rows = src.examples(0, 80)
  logits, trunk, seq = _reference_forward(teacher, rows)
  cat = lambda k: np.concatenate([b["teacher"][k] for b in got])[:80]  # noqa: E731
  np.testing.assert_allclose(cat("logits"), logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cat("trunk"), trunk, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cat("seq_summary"), seq, rtol=1e-5, atol=1e-5)
  valid = np.concatenate([b["teacher"]["valid"] for b in got])
  assert valid[:80].all() and not valid[80:].any()
  assert np.std(cat("logits")[:, 0]) > 1e-3  # not a constant (the check could pass vacuously)


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_knowledge_resume_is_exact_and_mismatch_fails(knowledge):
  src, d, _ = knowledge
  ks = kn.KnowledgeSource(src, d)
  it = ks.batches(B, repeat=True)
  first = [next(it) for _ in range(2)]
  st = it.state()
  rest = [next(it) for _ in range(3)]  # crosses the end of the pass into epoch 1
  resumed = ks.batches(B, repeat=True, state=st)
  for a in rest:
    b = next(resumed)
    jax.tree.map(np.testing.assert_array_equal, a, b)
  jax.tree.map(np.testing.assert_array_equal, rest[1], first[0])  # epoch 1 = epoch 0
  with pytest.raises(ValueError, match="seed"):
    ks.batches(B, seed=1)
  other = kn.KnowledgeSource(PlantedSource("teacher", "train", num_examples=80), d)
  with pytest.raises(ValueError, match="row mismatch"):
    next(other.batches(B))


def _student(teacher, opts, per_table=""):
  s = teacher.setup
  model_cfg, emb_cfg, opt_cfg = (
      setup_lib.model_config(ml_collections.ConfigDict(dict(
          preset="tiny", dtype="float32", overrides=dict(d_model=16, num_blocks=1, wukong_nf=2,
                                                         wukong_nl=2, trunk_hidden=(16,))))),
      ml_collections.ConfigDict(dict(dim=16, optimizer="rowwise_adagrad", lr=0.1,
                                     sharding="auto", id_policy="hash", memory_budget_gb=1.0,
                                     per_table=per_table)),
      ml_collections.ConfigDict(dict(name="adamw", lr=1e-2, warmup_steps=0, decay="constant",
                                     weight_decay=0.1, clip_norm=1.0)))
  return ttrain.build_student_run(s.spec, s.mesh, model_cfg, emb_cfg, opt_cfg, steps=4,
                                  batch_size=B, opts=opts,
                                  shared_vocab={"click_category": "category"})


def _host(run, state):
  return (jax.tree.map(np.asarray, state.params),
          jax.tree.map(np.asarray, emb_lib.export_state(run.plan, state.emb)))


def test_student_reads_per_table_widths(teacher):
  """`embedding.per_table` dims reach the student's projectors (not the default dim)."""
  run = _student(teacher, TransferOptions(), per_table="user: dim=4")
  assert run.feature_dims["user"] == run.plan.tables["user"].dim == 4
  assert run.feature_dims["ad"] == 16
  state = ttrain.init_student_state(run, 0)
  _, m = ttrain.evaluate_student(run, state, PlantedSource("student", "eval", num_examples=64),
                                 batch_size=B, max_batches=1)
  assert np.isfinite(m["eval_ne"])


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_frozen_shared_tables_and_blocks_are_bit_identical(teacher, knowledge):
  src, d, _ = knowledge
  opts = TransferOptions(distill_weights=(1.0, 0.5), share_tables=("user", "category"),
                         share_blocks=("dense_tok",), freeze_shared=True)
  run = _student(teacher, opts)
  state0 = ttrain.init_student_state(run, 0, teacher)
  p0, e0 = _host(run, state0)
  state, _, last = ttrain.train_steps(run, state0, kn.KnowledgeSource(src, d), steps=4,
                                      batch_size=B)
  p1, e1 = _host(run, state)
  tcanon = jax.tree.map(np.asarray, emb_lib.export_state(teacher.setup.plan, teacher.state.emb))
  for t in ("user", "category"):
    np.testing.assert_array_equal(e0[t]["weight"], tcanon[t]["weight"])  # shared ...
    np.testing.assert_array_equal(e1[t]["weight"], tcanon[t]["weight"])  # ... and frozen
    np.testing.assert_array_equal(e1[t]["accumulator"], e0[t]["accumulator"])
  assert tree_equal(p1["student"]["dense_tok"], jax.device_get(teacher.state.params["dense_tok"]))
  assert not np.array_equal(e1["ad"]["weight"], e0["ad"]["weight"])  # the rest trains
  assert not tree_equal(p1["student"]["wukong"], p0["student"]["wukong"])
  assert last["loss_soft"] > 0 and int(state.step) == 4


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_adapter_only_training_updates_only_the_adapter(teacher, knowledge):
  src, d, _ = knowledge
  opts = TransferOptions(distill_weights=(1.0, 1.0), adapter=True, train_student=False)
  run = _student(teacher, opts)
  state0 = ttrain.init_student_state(run, 1)
  p0, e0 = _host(run, state0)
  state, _, last = ttrain.train_steps(run, state0, kn.KnowledgeSource(src, d), steps=4,
                                      batch_size=B)
  p1, e1 = _host(run, state)
  assert tree_equal(p1["student"], p0["student"])
  assert tree_equal(e1, e0)
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b),
                                         p1["adapter"], p0["adapter"]))
  assert all(changed) and len(changed) == 6  # scale, shift, 2 x (kernel, bias)
  assert last["loss_adapt"] > 0


def test_transfer_loss_formula():
  rng = np.random.default_rng(0)
  s, z, za = (rng.normal(size=(6, 2)).astype(np.float32) for _ in range(3))
  y = (rng.random((6, 2)) < 0.4).astype(np.float32)
  m = np.ones((6, 2), np.float32)
  m[0, 1] = 0
  v = np.array([1, 1, 1, 1, 1, 0], np.float32)
  w, t = np.array([1.0, 0.5], np.float32), 2.0
  loss, parts = losses.transfer_loss(jnp.asarray(s), y, m, teacher_logits=z, adapted_logits=za,
                                     valid=v, task_weights=w, temperature=t)

  def bce(logit, target):
    p = 1 / (1 + np.exp(-logit.astype(np.float64)))
    return -(target * np.log(p) + (1 - target) * np.log(1 - p))
  hard = (m * bce(s, y)).sum() / m.sum()
  q = 1 / (1 + np.exp(-za.astype(np.float64) / t))
  soft = t * t * (v[:, None] * w[None] * bce(s / t, q)).sum() / v.sum()
  adapt = (m * bce(za, y)).sum() / m.sum()
  np.testing.assert_allclose(float(parts["hard"]), hard, rtol=1e-5)
  np.testing.assert_allclose(float(parts["soft"]), soft, rtol=1e-5)
  np.testing.assert_allclose(float(parts["adapt"]), adapt, rtol=1e-5)
  np.testing.assert_allclose(float(loss), hard + soft + adapt, rtol=1e-5)
  # The student gets no gradient through the soft target; the adapter none from L_soft.
  g = jax.grad(lambda a: losses.soft_target_loss(jnp.asarray(s), a, v, w, t))(jnp.asarray(za))
  assert not np.any(np.asarray(g))

