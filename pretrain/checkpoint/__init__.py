"""The checkpoint format: what training writes and the converters read (file names, tags,
`latest`, the metadata schema), `safe_load`, the only way checkpoint files are unpickled, and
`dcp_reader`, the only way torch.distributed.checkpoint folders are read (through `safe_load`).
Imports no training code (DeepSpeed only inside `safe_load`, for its allowlisted types)."""
