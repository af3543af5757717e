"""dcn_peer: the TorchRec peer with `--interaction dcn` (DLRM_DCN: 3 low-rank cross layers, rank 512).

  python scripts/benchmark.py --config dcn_peer --devices 1 --peer torchrec

Everything else as configs/dlrm_peer.py (data gem_jax.bench.peer_data, the peer
benchmarks/torchrec/bench.py, its venv `bash benchmarks/torchrec/setup.sh`).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dlrm_peer  # noqa: E402  pylint: disable=wrong-import-position


def get_config():
  c = dlrm_peer.get_config()
  c.model.name = "dcnv2"
  return c
