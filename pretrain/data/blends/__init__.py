"""Many prefixes drawn as one: `BlendedDataset` and a blend's build from its caches, mixtures that
change over a run (`--data-schedule`, the record a checkpoint keeps), the plan of what a blend
draws (`plan_blend`) and which document each sample of a batch comes from (`explain_batch`).

May import `pretrain.data.datasets`, `pretrain.data.config`, `pretrain.data.caches` and
`pretrain.data.files`.
"""
