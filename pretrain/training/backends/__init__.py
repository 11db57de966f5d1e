"""Training backends behind `pretrain.training.engine.Engine`, and the factory that chooses one
(`factory.py`). Everything that imports DeepSpeed or FSDP2 lives here; each backend package
imports its own library and nothing outside it does.

May import: `checkpoints/` (the rank-level writes), `report/` (per-source losses), `schedules/`,
the engine interface and the shared modules at the top of `training/`; never `loop/`, `run.py`
or `data_feed.py`. Within a backend, `engine.py` imports its helper modules and they take the
engine as the `held.Held` type, never importing `engine.py`."""
