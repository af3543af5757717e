"""gem_jax/train/setup.py: one model registry (class + FLOPs), one model-config translation,
one plan builder, shared by the trainer, the benchmark, the scale projection and transfer."""
import ml_collections
import pytest

from gem_jax import flops as flops_lib
from gem_jax.bench import runner, scale
from gem_jax.models import config as model_config_lib
from gem_jax.models.linear import linear_flops
from gem_jax.train import setup
from gem_jax.train.validate import ConfigError


def _block(**kw):
  return ml_collections.ConfigDict(dict(preset="tiny", **kw))


def test_every_model_entry_counts_its_own_flops():
  c = runner.load_config("tiny")
  src, _, _ = setup.sources(c)
  dims = {f.name: c.embedding.dim for f in src.spec.sparse}
  cfg = setup.model_config(c.model)
  for name, entry in setup.MODELS.items():
    c.model.name = name
    got = setup.train_flops_per_example(c.model, src.spec, dims)
    assert got == flops_lib.train_flops(entry.flops(cfg, src.spec, dims)) > 0, name
  c.model.name = "lr"
  lr = setup.train_flops_per_example(c.model, src.spec, dims)
  assert lr == flops_lib.train_flops(linear_flops(src.spec, dims))
  c.model.name = "dlrm"
  assert lr < setup.train_flops_per_example(c.model, src.spec, dims)


def test_scale_projection_counts_a_linear_model_as_linear():
  """The bench's copy of the FLOPs dispatch had no 'lr' case (DLRM FLOPs for a linear model)."""
  c = runner.load_config("tiny")
  c.model.name = "lr"
  facts = scale.model_facts(c)
  dims = {f.name: c.embedding.dim for f in facts.spec.sparse}
  assert facts.train_flops_per_example == flops_lib.train_flops(linear_flops(facts.spec, dims))


def test_model_config_block_fields_override_the_preset_only_where_set():
  preset = model_config_lib.get_config("tiny")
  cfg = setup.model_config(_block(overrides=dict(d_model=16, trunk_hidden=[8])))
  assert cfg.d_model == 16 and cfg.trunk_hidden == (8,)        # lists become tuples
  assert cfg.dtype == "float32" and cfg.fp8 == preset.fp8 and cfg.remat == preset.remat
  cfg = setup.model_config(_block(dtype="bfloat16", fp8=False, remat="none"))
  assert cfg.dtype == "bfloat16" and cfg.remat is None
  assert setup.model_config(_block(remat="dots")).remat == "dots"
  with pytest.raises(ConfigError, match="overrides"):
    setup.model_config(_block(overrides=dict(no_such_field=1)))
  with pytest.raises(ConfigError, match="preset 'nope'"):
    setup.model_config(ml_collections.ConfigDict(dict(preset="nope")))


def test_unknown_model_name_is_a_config_error():
  c = runner.load_config("tiny")
  c.model.name = "transformer"
  with pytest.raises(ConfigError, match="config.model.name='transformer'"):
    setup.model_factory(c.model, None, {})


def test_registered_models_take_part_everywhere():
  setup.register_model("dlrm_alias", "gem_jax.models.dlrm", "DLRM",
                       setup.MODELS["dlrm"].flops)
  try:
    c = runner.load_config("tiny")
    c.model.name = "dlrm_alias"
    facts = scale.model_facts(c)
    c.model.name = "dlrm"
    assert facts.train_flops_per_example == scale.model_facts(c).train_flops_per_example
  finally:
    del setup.MODELS["dlrm_alias"]
