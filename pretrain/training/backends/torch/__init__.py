"""The torch backend (--use-torch-fsdp2): FSDP2 over the data-parallel ranks with our TP layers,
`torch.distributed.pipelining` stages and schedules at PP > 1 (`pipeline.py`),
torch.distributed.checkpoint (DCP) files with background writes (`engine.build_torch_engine`)."""
