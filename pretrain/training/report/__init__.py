"""What a run tells its user: Megatron's log line and its parser, TensorBoard scalars, FLOPs and
MFU, per-source losses and consumption, validation sets and the evaluator.

May import: the engine interface and the shared modules at the top of `training/`; never
`loop/`, `checkpoints/`, `schedules/`, a backend, `run.py` or `data_feed.py`."""
