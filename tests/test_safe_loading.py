"""Loading a serving artifact or a checkpoint never runs code from it.

The payload: an object array whose unpickling creates a marker directory. A crafted
artifact (params or a table holding it) and a crafted checkpoint (its JSON items and
array metadata replaced by the pickle, resealed so the integrity check passes) must
fail with a clear error and leave no marker; a manifest with content an export never
writes is refused naming the field; no module loads pickles (a scan of the sources).
"""
import json
import os
import re
import shutil

import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.serving import export, load, loader
from gem_jax.train import integrity
from gem_jax.train.checkpoint import CheckpointManager, abstract_like
from test_checkpoint import make_state
from test_serving import _fresh_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Payload:
  """Unpickling it calls os.mkdir(marker)."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return os.mkdir, (self.marker,)


def _pickled_array(marker) -> np.ndarray:
  return np.array([_Payload(marker), 1], dtype=object)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
  """A real artifact of a fresh tiny DLRM (one fixed batch size: a quick export)."""
  out = str(tmp_path_factory.mktemp("art") / "dlrm")
  export.export_artifact(_fresh_model("dlrm"), out, batch_sizes=(8,))
  return out


@pytest.fixture
def art(artifact, tmp_path):
  out = str(tmp_path / "art")
  shutil.copytree(artifact, out)
  return out


def _manifest(art):
  with open(os.path.join(art, loader.MANIFEST)) as f:
    return json.load(f)


def _write_manifest(art, m):
  with open(os.path.join(art, loader.MANIFEST), "w") as f:
    json.dump(m, f)


def test_the_payload_is_live(tmp_path):
  """The crafted file does run code when pickles are allowed (so the tests below mean
  something)."""
  marker = str(tmp_path / "ran")
  np.save(tmp_path / "x.npy", _pickled_array(marker), allow_pickle=True)
  np.load(tmp_path / "x.npy", allow_pickle=True)
  assert os.path.isdir(marker)


def test_the_artifact_loads(art):
  assert load(art).tasks


def test_pickled_params_cannot_run_code(art, tmp_path):
  marker = str(tmp_path / "ran")
  np.savez(os.path.join(art, "params.npz"), w=_pickled_array(marker))
  with pytest.raises(ValueError, match=r"params\.npz: not plain numeric arrays .*no pickled"):
    load(art)
  assert not os.path.exists(marker)


def test_pickled_table_cannot_run_code(art, tmp_path):
  marker = str(tmp_path / "ran")
  table = next(iter(_manifest(art)["tables"].values()))
  file = os.path.join(art, next(iter(table["files"].values())))
  np.save(file, _pickled_array(marker), allow_pickle=True)
  with pytest.raises(ValueError, match=re.escape(file) + r": not a plain numeric array file"):
    load(art)
  assert not os.path.exists(marker)


def _outside(art):
  os.symlink("/etc/hostname", os.path.join(art, "link.npz"))
  return "link.npz"


@pytest.mark.parametrize("change, msg", [
    (lambda m, a: [m], r"expected a JSON object, got list"),
    (lambda m, a: {**m, "loader_hook": "os.system"}, r"unexpected field\(s\) \['loader_hook'\]"),
    (lambda m, a: {**m, "params": "../../params.npz"}, r"params = '\.\./\.\./params\.npz' is "
                                                       r"not a file inside the artifact"),
    (lambda m, a: {**m, "params": "/etc/passwd"}, r"params = '/etc/passwd' is not a file inside"),
    (lambda m, a: {**m, "params": _outside(a)}, r"params = 'link\.npz' leads outside"),
    (lambda m, a: {**m, "params": 3}, r"field 'params' has type int"),
    (lambda m, a: {**m, "functions": {"__import__": "score_8.jaxexport"}},
     r"functions key '__import__' is neither 'b' nor a batch size"),
    (lambda m, a: {**m, "tables": {k: {**t, "dtype": "object"} for k, t in m["tables"].items()}},
     r"dtype 'object' / id_policy .* not among"),
    (lambda m, a: {**m, "inputs": [{**m["inputs"][0], "dtype": "O"}] + m["inputs"][1:]},
     r"inputs entry .* is not \{path, shape, numeric dtype\}"),
    (lambda m, a: {k: v for k, v in m.items() if k != "tables"}, r"field 'tables' is missing"),
], ids=["list", "unknown-field", "dotdot", "absolute", "symlink", "type", "function-key",
        "table-dtype", "input-dtype", "missing"])
def test_manifest_with_unexpected_content_is_refused(art, change, msg):
  _write_manifest(art, change(_manifest(art), art))
  with pytest.raises(ValueError, match=msg):
    load(art)


def test_manifest_that_is_not_json(art):
  with open(os.path.join(art, loader.MANIFEST), "wb") as f:
    f.write(b"\x80\x04\x95 not json")
  with pytest.raises(ValueError, match=r"manifest\.json: not a JSON manifest"):
    load(art)


def test_scoring_function_that_is_not_an_export(art):
  m = _manifest(art)
  with open(os.path.join(art, m["functions"]["8"]), "wb") as f:
    f.write(b"\x80\x04not a flatbuffer")
  with pytest.raises(ValueError, match=r"score_8\.jaxexport: not a serialized jax\.export"):
    load(art)


def test_custom_calls_outside_the_stable_set_are_refused():
  class Fake:
    def mlir_module(self):
      return ('%0 = stablehlo.custom_call @xla_ffi_python_cpu_callback(%arg0) '
              '{backend_config = ""} : (tensor<2xf32>) -> tensor<2xf32>')
  with pytest.raises(ValueError, match=r"custom call 'xla_ffi_python_cpu_callback'"):
    loader.check_function(Fake(), "f.jaxexport")


# ------------------------------------------------------------ checkpoints --

@pytest.mark.parametrize("victim", ["data/metadata", "config/metadata", "state/_METADATA"])
def test_crafted_checkpoint_cannot_run_code(tmp_path, victim):
  """Orbax reads these as JSON (and the arrays through tensorstore): a pickle there is
  an error, never unpickled, even when the integrity manifest vouches for it."""
  import pickle  # pylint: disable=import-outside-toplevel  (only to craft the payload)
  state, _ = make_state(make_mesh(1, 8))
  d = tmp_path / "ckpt"
  with CheckpointManager(str(d), save_every=1) as ckpt:
    ckpt.save(1, state, data_state={"pos": 1})
  marker = str(tmp_path / "ran")
  with open(d / "1" / victim, "wb") as f:
    f.write(pickle.dumps(_Payload(marker)))
  integrity.write_manifest(str(d / "1"))       # resealed: only the format stops it
  with CheckpointManager(str(d), save_every=1) as ckpt:
    with pytest.raises(Exception):  # noqa: B017  (Orbax's own error; what matters is below)
      ckpt.restore(abstract_like(state))
  assert not os.path.exists(marker)


def test_checkpoint_manifest_with_unexpected_content_is_corrupt(tmp_path, caplog):
  state, _ = make_state(make_mesh(1, 8))
  d = tmp_path / "ckpt"
  with CheckpointManager(str(d), save_every=1, keep=3) as ckpt:
    ckpt.save(1, state)
    ckpt.save(2, state)
  for content, msg in (([1, 2], "expected an object with a 'files' object"),
                       ({"files": {"../../x": [1, "0"]}}, "is not a path inside the checkpoint"),
                       ({"files": {"a": "big"}}, r"entry of 'a' is 'big'")):
    (d / "2" / integrity.MANIFEST).write_text(json.dumps(content))
    with pytest.raises(integrity.CorruptCheckpointError, match=msg):
      integrity.verify(str(d / "2"))
  with CheckpointManager(str(d), save_every=1) as ckpt:
    assert ckpt.restore(abstract_like(state)).step == 1
  assert "unreadable manifest" in caplog.text


# ------------------------------------------------------------ the sources --

def _sources():
  for top in ("gem_jax", "scripts"):
    for root, _, names in os.walk(os.path.join(ROOT, top)):
      for n in names:
        if n.endswith(".py"):
          path = os.path.join(root, n)
          with open(path, encoding="utf-8") as f:
            yield os.path.relpath(path, ROOT), f.read()


def _call_args(text, i):
  """The text of a call's arguments, from just after its '(' to its matching ')'."""
  depth, j = 1, i
  while depth and j < len(text):
    depth += {"(": 1, ")": -1}.get(text[j], 0)
    j += 1
  return text[i:j]


def test_no_module_loads_pickles():
  bad = []
  for rel, text in _sources():
    if re.search(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|joblib)\b", text, re.M):
      bad.append(f"{rel}: imports a pickle module")
    if re.search(r"\btorch\.load\(|allow_pickle\s*=\s*True|pd\.read_pickle", text):
      bad.append(f"{rel}: loads pickles")
    for m in re.finditer(r"\bnp\.load\(", text):
      call = _call_args(text, m.end())
      if "allow_pickle=False" not in call and "**" not in call:
        line = text.count("\n", 0, m.start()) + 1
        bad.append(f"{rel}:{line}: np.load without allow_pickle=False")
  assert not bad, bad
