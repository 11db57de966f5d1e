"""What a run writes and how it comes back: the save (`checkpointing.py`) and its rank-level
writes, the resume (`resume.py`), whether a run can resume a checkpoint (`compatible.py`) and
what it continues or refuses (LR schedule, tokenizer and data changes), the --save lock.

May import: `report/` (logging), `schedules/` (the LR scheduler a resume continues), the engine
interface and the shared modules at the top of `training/`; never `loop/`, a backend, `run.py`
or `data_feed.py`. The file format itself is `pretrain.checkpoint`."""
