"""The torch backend: FSDP2 over data parallelism, `torch.distributed.pipelining` stages, DCP."""
