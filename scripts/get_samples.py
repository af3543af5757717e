"""Fetches (or checks) the small real public samples that some tests and configs read.

  python scripts/get_samples.py --dest ../shared/data      # download + verify sha256
  python scripts/get_samples.py --dest ../shared/data --check   # verify what is there

The files are not part of gem_jax: their licences do not all allow redistribution
(Criteo, Avazu, Alimama and ByteDance data are research-only; MovieLens and UCI
adult allow it). Each one is a byte-for-byte copy of a file in a public GitHub
repository at a pinned commit, so a download is checked against its sha256.
Tests that need them read `$GEM_JAX_DATA` (default `../shared/data` beside the
checkout) and are skipped with one reason when the folder is absent.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import urllib.request
from typing import NamedTuple

RAW = "https://raw.githubusercontent.com"


class Sample(NamedTuple):
  name: str      # file name under --dest
  repo: str      # GitHub owner/name
  commit: str    # pinned commit
  path: str      # path inside the repository
  sha256: str


_WIDE = ("Lapis-Hong/Wide-ResDNN", "9889f939deb904a35692e2efdc6ab4f743a7df71")
_ML = ("qcymkxyc/RecSys", "cb313bf92f80d3cd7c7bde39b12ab4319ccf61a8")
_ADULT = ("shawroad/DeepCTR-pytorch", "86c12955d1230d47eb28dcbdb70e0b8974f21fa4")
SAMPLES = (
    Sample("criteo_kaggle_8k_train.tsv", *_WIDE, "data/criteo/train.csv",
           "2b0614035f6c931dc4ac2c1a1a26fa954f2b9231703f3a77bcdd53d9d9f29872"),
    Sample("criteo_kaggle_8k_dev.tsv", *_WIDE, "data/criteo/dev.csv",
           "7ac8a164e43a9903be3d43e640bcd464cfa0d96d7a652ec8ef8a33fe97cac6b9"),
    Sample("avazu_9k_train.csv", *_WIDE, "data/avazu/train.csv",
           "49fb8cdcadfd9030a6fcb8cd97fe8205d94b84723ee8292e229d741ce1362e4f"),
    Sample("avazu_9k_dev.csv", *_WIDE, "data/avazu/dev.csv",
           "1dbd14ef356202a106766d175ab20dfa182838c8cf77e6b018dd18df05c7e757"),
    Sample("movielens_latest_small_2016_ratings.csv", *_ML, "data/ml-latest-small/ratings.csv",
           "b4239649fbf90ebf405c56c3ae1d929d9e7c86fc1a3a80cbef1c884df593ef73"),
    Sample("movielens_latest_small_2016_movies.csv", *_ML, "data/ml-latest-small/movies.csv",
           "43d1736d3c688eb5b7856473c36d86a1c345676cab256c91720c1f6984d263b5"),
    Sample("movielens_latest_small_2016_README.txt", *_ML, "data/ml-latest-small/README.txt",
           "59be481ddf3fab0f9f7cf2f73e0db4d0920a413a313c911b62bd01ee8816ea2f"),
    Sample("alimama_display_dmr_500.csv", "PaddlePaddle/PaddleRec",
           "656326adf3c4117c11ec0eff5e8f61acd8191c2a",
           "models/rank/dmr/data/sample_data/alimama_sampled_train.txt",
           "046a8d71a4912a5647adc93a6b5cf951dee1407dd72deb164652ef90c1a3f819"),
    Sample("byterec_icme2019_multitask_1000.tsv", "shenweichen/DeepCTR-Torch",
           "113d90b65af6beeedbfe9c45042a56e59ef8022f", "examples/byterec_sample.txt",
           "92e912a089d081531882ef2cc4430546e5a02ddfb96538db2e0291ccf911e325"),
    Sample("uci_adult_train.csv", *_ADULT, "MMoE/data/adult.data",
           "ea895aae047aa83ca757e3024a029be8b11806c656ad2c5b1efd8cec28af19ad"),
    Sample("uci_adult_test.csv", *_ADULT, "MMoE/data/adult.test",
           "10ab70aad17401e173c0096b6775f78362409517422ceb26c80f5f04dbc2e02e"),
)


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def check(dest: str) -> list[str]:
  """Problems with the samples in `dest` (missing or wrong checksum); empty when all good."""
  problems = []
  for s in SAMPLES:
    path = os.path.join(dest, s.name)
    if not os.path.exists(path):
      problems.append(f"{path}: missing")
    elif (got := sha256_of(path)) != s.sha256:
      problems.append(f"{path}: sha256 {got}, expected {s.sha256}")
  return problems


def fetch(dest: str, base_url: str = RAW) -> None:
  """Downloads every sample missing from `dest`; a file with the wrong sha256 is refused."""
  os.makedirs(dest, exist_ok=True)
  for s in SAMPLES:
    path = os.path.join(dest, s.name)
    if os.path.exists(path) and sha256_of(path) == s.sha256:
      continue
    url = f"{base_url}/{s.repo}/{s.commit}/{s.path}"
    tmp = path + ".part"
    with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
      f.write(r.read())
    if (got := sha256_of(tmp)) != s.sha256:
      os.remove(tmp)
      raise RuntimeError(f"{url}: sha256 {got}, expected {s.sha256}; not written")
    os.replace(tmp, path)
    print(f"{s.name}  <- {s.repo}@{s.commit[:8]}:{s.path}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dest", default=os.environ.get("GEM_JAX_DATA", os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")))
  p.add_argument("--check", action="store_true", help="only verify the files in --dest")
  p.add_argument("--base-url", default=RAW, help="mirror of raw.githubusercontent.com")
  a = p.parse_args(argv)
  if not a.check:
    fetch(a.dest, a.base_url)
  problems = check(a.dest)
  for line in problems:
    print(line, file=sys.stderr)
  if not problems:
    print(f"{len(SAMPLES)} samples verified in {os.path.abspath(a.dest)}")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
