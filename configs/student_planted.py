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
  c.data.update(kind="transfer_planted", role="student", train_examples=2048,
                eval_examples=16384, batch_size=128, eval_batch_size=128)
  c.knowledge.update(train="runs/knowledge/train", eval="runs/knowledge/eval")
  c.teacher.update(config=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                       "transfer_teacher_planted.py"), workdir="runs/teacher")
  c.model.overrides.update(
      d_model=16, num_blocks=1, wukong_nf=4, wukong_nl=4, wukong_k=4, wukong_mlp=(32,),
      trunk_hidden=(32,), head_hidden=(16,))
  c.embedding.memory_budget_gb = 1.0
  c.optim.update(lr=3e-3, warmup_steps=10)
  c.train.update(steps=200, log_every=50)
  # distillation per task from the Student Adapter's corrected logits, representation
  # transfer from the teacher's trunk, parameter sharing of three tables and dense_tok
  c.transfer.update(distill_weights=(1.0, 1.0), adapter=True, teacher_emb="trunk",
                    share_tables=("user", "ad", "category"), share_blocks=("dense_tok",))
  return c
