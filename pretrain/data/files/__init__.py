"""The dataset files: Megatron's `.bin/.idx` pairs (read, validated, written, merged), the
`PREFIX.json` sidecar of what made them, the largest token ids of data without one, which pairs a
glob or folder names, and preprocessing a corpus (JSONL, parquet, Hugging Face) into them.

Imports nothing else of `pretrain.data`.
"""
