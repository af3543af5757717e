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
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)

import gem_jax.transfer.planted  # noqa: E402,F401  (registers data.kind 'transfer_planted')


def get_config():
  c = base.student_config()
  c.data.kind = "transfer_planted"
  c.data.role = "student"
  c.data.train_examples = 2048
  c.data.eval_examples = 16384
  c.data.batch_size = 128
  c.data.eval_batch_size = 128
  c.knowledge.train = "runs/knowledge/train"
  c.knowledge.eval = "runs/knowledge/eval"
  c.teacher.config = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  "transfer_teacher_planted.py")
  c.teacher.workdir = "runs/teacher"
  c.model.overrides.update(
      d_model=16, num_blocks=1, wukong_nf=4, wukong_nl=4, wukong_k=4, wukong_mlp=(32,),
      trunk_hidden=(32,), head_hidden=(16,))
  c.embedding.memory_budget_gb = 1.0
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 10
  c.train.steps = 200
  c.train.log_every = 50
  c.transfer.distill_weights = (1.0, 1.0)   # per task
  c.transfer.adapter = True
  c.transfer.teacher_emb = "trunk"          # representation transfer
  c.transfer.share_tables = ("user", "ad", "category")  # parameter sharing
  c.transfer.share_blocks = ("dense_tok",)
  return c
