"""Knowledge transfer from a foundation (teacher) model to vertical students (GEM.md §3.5).

  knowledge.py  knowledge files (sharded rows + index) and the source that zips them with data
  generate.py   restore a teacher sharded like training and write its knowledge, streaming
  losses.py     distillation (temperature, per-task weights) with the Student Adapter
  student.py    StudentBundle, transfer options, frozen masks, parameter sharing, FLOPs
  step.py       the student train / eval steps
  train.py      student runs (library + `python -m gem_jax.transfer.train`)
  planted.py    planted data of the transfer benchmark (stale teacher, fresh shifted student)
  benchmark.py  the transfer benchmark (scripts/transfer_benchmark.py)

See docs/knowledge_transfer.md.
"""
