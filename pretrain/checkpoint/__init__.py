"""The checkpoint format: what training writes and the converters read (file names, tags,
`latest`, the metadata schema). Imports no training code and no DeepSpeed."""
