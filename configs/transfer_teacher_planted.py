"""transfer_teacher_planted: the teacher of the transfer benchmark (planted data, old labels).

GEM (small front end, one InterFormer block) trained on the teacher role of the
planted transfer data: three domains, labels of the old period
(gem_jax/transfer/planted.py). Then generate its knowledge for a student:

  python scripts/train.py --config configs/transfer_teacher_planted.py --workdir runs/teacher
  python scripts/generate_knowledge.py --teacher_config configs/transfer_teacher_planted.py \
    --teacher_workdir runs/teacher --data_config configs/student_planted.py --split train \
    --out runs/knowledge/train
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)
import gem_jax.transfer.planted  # noqa: E402,F401  (registers data.kind 'transfer_planted')


def get_config():
  c = base.get_config()
  c.data.update(kind="transfer_planted", role="teacher", eval_examples=8192,
                train_examples=0)  # 0: an endless stream
  c.model.preset = "tiny"
  c.model.overrides.update(
      d_model=16, num_blocks=1, wukong_nf=4, wukong_nl=4, num_cls=2, num_pma=1, num_recent=1,
      num_x_summary=2, num_queries=1, trunk_hidden=(32,), pyramid=(1.0,),
      trunk_gate=True)  # as docs/knowledge_transfer.md measured it (the gate was GEM's default)
  c.embedding.update(memory_budget_gb=1.0, lr=0.05)  # the rate it was measured with
  c.optim.lr = 3e-3
  c.train.update(steps=600, log_every=100, eval_every=600, checkpoint_every=600, keep=1)
  return c
