"""student_planted: a vertical student of the planted transfer benchmark (fresh labels, one domain).

Reads the student role of the planted data (gem_jax/transfer/planted.py) zipped
with the teacher's knowledge of it, and trains a small Student with any mix of
distillation, Student Adapter, representation transfer and parameter sharing
(the `transfer` block; docs/knowledge_transfer.md):

  python scripts/train.py --config configs/transfer_teacher_planted.py --workdir runs/teacher
  for split in train eval; do python scripts/generate_knowledge.py \
    --teacher_config configs/transfer_teacher_planted.py --teacher_workdir runs/teacher \
    --data_config configs/student_planted.py --split $split --out runs/knowledge/$split; done
  python -m gem_jax.transfer.train --config configs/student_planted.py --workdir runs/student
"""
import os

import ml_collections

import gem_jax.transfer.planted  # noqa: F401  (registers data.kind 'transfer_planted')

_HERE = os.path.dirname(os.path.abspath(__file__))


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh = (1, -1)

  c.data = ml_collections.ConfigDict(dict(
      kind="transfer_planted", role="student", seed=0, train="", eval="",
      train_examples=2048, eval_examples=16384, batch_size=128, eval_batch_size=128,
      shuffle_buffer=0, bad_row_limit=0.01))
  c.knowledge = ml_collections.ConfigDict(dict(train="runs/knowledge/train",
                                               eval="runs/knowledge/eval"))
  c.teacher = ml_collections.ConfigDict(dict(
      config=os.path.join(_HERE, "transfer_teacher_planted.py"), workdir="runs/teacher"))

  c.model = ml_collections.ConfigDict(dict(
      preset="tiny", dtype="float32", overrides=ml_collections.ConfigDict(dict(
          d_model=16, num_blocks=1, wukong_nf=4, wukong_nl=4, wukong_k=4, wukong_mlp=(32,),
          trunk_hidden=(32,), head_hidden=(16,)))))
  c.embedding = ml_collections.ConfigDict(dict(
      dim=16, optimizer="rowwise_adagrad", lr=0.05, warmup_steps=0, sharding="auto",
      id_policy="hash", memory_budget_gb=1.0, share_tables=True))
  c.optim = ml_collections.ConfigDict(dict(
      name="adamw", lr=3e-3, warmup_steps=10, decay="cosine", weight_decay=0.0, clip_norm=1.0))
  c.train = ml_collections.ConfigDict(dict(steps=200, log_every=50))

  c.transfer = ml_collections.ConfigDict()
  c.transfer.distill_weights = (1.0, 1.0)   # per task; () = no distillation
  c.transfer.temperature = 1.0
  c.transfer.adapter = True                 # distil from the Student Adapter's corrected logits
  c.transfer.adapter_hidden = (16,)
  c.transfer.teacher_emb = "trunk"          # representation transfer ('' = off)
  c.transfer.share_tables = ("user", "ad", "category")  # parameter sharing
  c.transfer.share_blocks = ("dense_tok",)
  c.transfer.freeze_shared = False
  c.transfer.train_student = True           # False: adapter-only training
  return c
