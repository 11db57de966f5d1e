"""Training: one run configured (`run_config.py`: `RunConfig`), set up (`run.py`:
`pretrain(RunConfig)`), fed (`data_feed.py`) and handed to the loop; nothing in training but
these three imports them. At this level also sit what every room shares: the backend interface
(`engine.py`, which imports no backend), what every backend's iteration shares (`step.py`), the
run's position (`state.py`), the process group and its helpers (`distributed.py`), the precision
flags (`precision.py`) and the check that all ranks run one job (`rank_agreement.py`).

Rooms (docs/ARCHITECTURE.md; tests/test_layers.py holds the rules): `loop/`, `checkpoints/`,
`report/`, `schedules/`, `backends/`."""
