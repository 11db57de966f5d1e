"""One prefix's samples: the numba index kernels (document, sample and shuffle indices),
`GPTDataset` and its cached indices, megatron-core's mock data, and the rank-aware samplers and
DataLoader that turn a dataset into micro-batches.

May import `pretrain.data.config`, `pretrain.data.caches` and `pretrain.data.files`.
"""
