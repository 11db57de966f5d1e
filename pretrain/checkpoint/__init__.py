"""The checkpoint format: what training writes and the converters read (file names, tags,
`latest`, the metadata schema), and `safe_load`, the only way checkpoint files are unpickled.
Imports no training code (DeepSpeed only inside `safe_load`, for its allowlisted types)."""
