"""transfer_teacher_planted: the teacher of the transfer benchmark (planted data, old labels).

GEM (small front end, one InterFormer block) trained on the teacher role of the
planted transfer data: three domains, labels of the old period
(gem_jax/transfer/planted.py). Then generate its knowledge for a student:

  python scripts/train.py --config configs/transfer_teacher_planted.py --workdir runs/teacher
  python scripts/generate_knowledge.py --teacher_config configs/transfer_teacher_planted.py \
    --teacher_workdir runs/teacher --data_config configs/student_planted.py --split train \
    --out runs/knowledge/train
"""
import ml_collections

import gem_jax.transfer.planted  # noqa: F401  (registers data.kind 'transfer_planted')


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh = (1, -1)
  c.data = ml_collections.ConfigDict()
  c.data.kind = "transfer_planted"
  c.data.train = ""
  c.data.eval = ""
  c.data.shuffle_buffer = 0
  c.data.bad_row_limit = 0.01
  c.data.role = "teacher"
  c.data.seed = 0
  c.data.batch_size = 256
  c.data.eval_batch_size = 256
  c.data.train_examples = 0          # 0: an endless stream
  c.data.eval_examples = 8192
  c.model = ml_collections.ConfigDict()
  c.model.name = "gem"
  c.model.preset = "tiny"
  c.model.dtype = "float32"
  c.model.fp8 = False
  c.model.remat = "none"
  c.model.overrides = ml_collections.ConfigDict(dict(
      d_model=16, num_blocks=1, wukong_nf=4, wukong_nl=4, num_cls=2, num_pma=1, num_recent=1,
      num_x_summary=2, num_queries=1, trunk_hidden=(32,), pyramid=(1.0,)))
  c.embedding = ml_collections.ConfigDict(dict(
      dim=16, optimizer="rowwise_adagrad", lr=0.05, warmup_steps=0, sharding="auto",
      id_policy="hash", memory_budget_gb=1.0, share_tables=True))
  c.optim = ml_collections.ConfigDict(dict(
      name="adamw", lr=3e-3, warmup_steps=20, decay="cosine", weight_decay=0.0, clip_norm=1.0))
  c.train = ml_collections.ConfigDict()
  c.train.steps = 600
  c.train.log_every = 100
  c.train.eval_every = 600
  c.train.eval_batches = 0
  c.train.checkpoint_every = 600
  c.train.keep = 1
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  c.train.stop_at = 0
  return c
