"""Benchmark library: step timing, the TorchRec peer (data and runner), the scale model.

  timing.py    step-time statistics, machine load, CPU contention meter
  peer_data.py the comparison's synthetic batches (numpy only; benchmarks/torchrec imports it)
  peer.py      the TorchRec peer (benchmarks/torchrec/bench.py): its data as a source, its command
  runner.py    one benchmark run of a config (reuses the trainer's setup and step)
  network.py   communication volumes of a sharding plan and a network model -> projection
"""
