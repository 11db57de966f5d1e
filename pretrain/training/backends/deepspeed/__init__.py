"""The DeepSpeed backend: `deepspeed.initialize` with ZeRO over the data-parallel ranks, its
pipeline engine at PP > 1, DeepSpeed's checkpoint files (`engine.build_deepspeed_engine`)."""
