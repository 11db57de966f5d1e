"""Megatron's data, from a corpus to the micro-batches of a run, in rooms that import one way.

Bottom up (tests/test_layers.py enforces it; a room imports only itself and the rooms below):

- `files/`: the `.bin/.idx` pairs, their sidecars, and preprocessing a corpus into them.
- `caches/`: the index caches on disk (Megatron's per-prefix files, a blend's one file).
- `config.py`, `schedule.py`: `DataConfig` and the data flags (`--data-schedule`'s file).
- `datasets/`: the numba index kernels, `GPTDataset`, mock data and the rank-aware loader.
- `blends/`: blends and mixtures that change: their datasets, plans and explanations.
- `builder.py`, `checks.py`, `gc_pause.py`: a run's datasets, built; its data, checked against
  its tokenizer and summarised for its checkpoints.
"""
