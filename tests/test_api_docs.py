"""The API reference (pdoc, from docstrings) builds and documents the public layers and
the embedding package with their constructor arguments (docs/model.md says how)."""
import html
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ["gem_jax.layers", "gem_jax.embedding"]


def _text(path) -> str:
  return html.unescape(re.sub(r"<[^>]+>", "", path.read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def api(tmp_path_factory):
  pytest.importorskip("pdoc", reason="pdoc is in the test extra of setup.cfg")
  out = tmp_path_factory.mktemp("api")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run([sys.executable, "-m", "pdoc", "--docformat", "google", "-o", str(out),
                      *MODULES], capture_output=True, text=True, cwd=ROOT, env=env,
                     timeout=300, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  return out


def test_layers_reference_has_constructors_with_arguments(api):
  wukong = _text(api / "gem_jax" / "layers" / "wukong.html")
  sig = re.search(r"WukongStack\((.*?)\)\s*View Source", wukong, re.S)
  assert sig, "no WukongStack constructor signature"
  for arg in ("n: int", "d: int", "num_layers: int", "n_f: int", "n_l: int", "k: int",
              "mlp_hidden", "cross_layer: bool = True", "rngs", "remat"):
    assert arg in sig.group(1), arg
  assert "n_out = n_f + n_l" in wukong and "Arguments:" in wukong
  for mod, classes in {"attention": ("Attention", "CrossAttention", "PMA"),
                       "mlp": ("MLP", "LayerNorm"), "heads": ("MultiTaskHeads", "GroupedMLP"),
                       "features": ("DenseTokenizer", "SparseProjector", "SequenceEmbedder"),
                       "sequence": ("SequenceBlock", "PyramidStack"),
                       "interformer": ("InterFormerBlock",), "cross": ("LowRankCrossNet",),
                       "dense": ("Dense",), "norm": ("RMSNorm",)}.items():
    text = _text(api / "gem_jax" / "layers" / f"{mod}.html")
    for c in classes:
      assert re.search(rf"\b{c}\(\s*\w+: ", text), f"{mod}.{c}: no constructor signature"


def test_embedding_reference_has_configs_and_planner_arguments(api):
  text = _text(api / "gem_jax" / "embedding.html")
  for needle in ("TableConfig", "id_policy: str = 'error'", "vocab: int | None = None",
                 "FeatureConfig", "SparseOptimizerConfig", "plan_embeddings",
                 "memory_budget_bytes: int | None = None", "prepare_ids", "export_state",
                 "apply_sparse_updates", "table_collisions", "batch_sharding"):
    assert needle in text, needle
