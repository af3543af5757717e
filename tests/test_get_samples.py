"""scripts/get_samples.py: the manifest matches the samples, downloads are checksum-verified."""
import importlib.util
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "get_samples", os.path.join(ROOT, "scripts", "get_samples.py"))
get_samples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(get_samples)


def _mirror(tmp_path, content_of):
  """A file:// tree laid out as raw.githubusercontent.com: owner/name/commit/path."""
  base = tmp_path / "mirror"
  for s in get_samples.SAMPLES:
    p = base / s.repo / s.commit / s.path
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content_of(s))
  return "file://" + str(base)


def test_download_with_a_wrong_checksum_is_refused_and_not_written(tmp_path):
  url = _mirror(tmp_path, lambda s: b"not the sample\n")
  dest = tmp_path / "data"
  with pytest.raises(RuntimeError, match=r"criteo_kaggle_8k_train|data/criteo/train.csv"):
    get_samples.fetch(str(dest), url)
  assert not any(dest.iterdir())            # neither the file nor a .part is left behind
  assert len(get_samples.check(str(dest))) == len(get_samples.SAMPLES)   # all "missing"


def test_check_names_the_file_and_both_checksums(tmp_path):
  s = get_samples.SAMPLES[0]
  (tmp_path / s.name).write_bytes(b"x")
  problems = get_samples.check(str(tmp_path))
  assert any(s.name in p and s.sha256 in p for p in problems)


def test_real_samples_match_the_manifest(real_data_dir):
  assert get_samples.check(real_data_dir) == []


def test_fetch_from_a_mirror_gives_verified_copies(real_data_dir, tmp_path):
  url = _mirror(tmp_path, lambda s: open(os.path.join(real_data_dir, s.name), "rb").read())
  dest = tmp_path / "data"
  assert get_samples.main(["--dest", str(dest), "--base-url", url]) == 0
  assert get_samples.check(str(dest)) == []
  shutil.rmtree(tmp_path / "mirror")         # a second run finds everything in place
  assert get_samples.main(["--dest", str(dest), "--base-url", url]) == 0
