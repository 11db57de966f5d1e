"""One iteration after another (`loop.py`), and every rule for stopping or skipping one: NaN/Inf
divergence, loss spikes, --iterations-to-skip, exit signals, manual garbage collection.

May import: `checkpoints/` (a spike rewind reloads, a stop commits a pending save), `report/`,
`schedules/`, the engine interface and the shared modules at the top of `training/`; never a
backend, `run.py` or `data_feed.py`."""
