"""The index caches on disk: Megatron's per-prefix files (names from Megatron's descriptions,
bound to the `.idx` they came from, locked, validated on load), their background writer, and a
blend's consolidated one-file cache.

May import `pretrain.data.files`.
"""
