"""Mixture of experts (Megatron-core's MoE layer, on this project's parallel layers).

    config.py       the MoE fields' rules (`moe_problems`) and --moe-layer-freq (`moe_layer_pattern`)
    routing.py      top-k routing, group-limited routing, capacity and token dropping
    losses.py       load-balancing and z losses; attaching them to the backward pass
    router.py       TopKRouter: gating, routing, aux losses, the DeepSeek-V3 expert bias
    permutation.py  tokens sorted by expert and back
    dispatcher.py   all-gather and all-to-all token exchange over the expert-parallel group
    experts.py      the local experts: one grouped GEMM, or a loop over experts
    layer.py        MoELayer: router -> dispatcher -> experts -> combine (+ shared experts)
    metrics.py      per-iteration statistics and the expert-bias update (`finish_iteration`)

The package imports nothing on its own, so `pretrain.model.config` can read `moe/config.py`.
"""
