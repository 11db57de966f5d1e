"""Process groups for tensor (TP), data (DP) and pipeline (PP) parallelism.

Every global rank has coordinates (tp_rank, dp_rank, pp_rank) with TP varying fastest, then DP,
then PP:

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

This is Megatron's default order and DeepSpeed's `PipeModelDataParallelTopology(num_pp, num_mp,
num_dp)` (axes pipe, data, model), so TP peers are neighbours (one node, NVLink) and DeepSpeed's
pipeline grid and our groups agree on who is who. Example, 8 ranks, tp=2, pp=2 (dp=2):
TP groups [0,1] [2,3] [4,5] [6,7]; DP groups [0,2] [1,3] [4,6] [5,7]; PP groups [0,4] [1,5] [2,6]
[3,7]; embedding groups (first and last stage) = the PP groups here.

Expert layers (mixture of experts) re-cut each pipeline stage's tp x dp ranks, as Megatron does:
within a stage, index i = tp_rank + tp * dp_rank is split into (etp_rank, ep_rank, edp_rank) with
expert TP fastest, then EP, then expert DP:

    i = etp_rank + etp * (ep_rank + ep * edp_rank)

EP groups hold different experts, ETP groups split one expert's weights, EDP groups hold the same
expert shard (their gradients are reduced together). Example, 4 ranks, tp=2 (dp=2), ep=2, etp=1:
EP groups [0,1] [2,3] (the TP peers, whose sequence chunks then feed each other's experts), EDP
groups [0,2] [1,3]. `get_expert_tensor_and_model_parallel_group` is ETP x EP (the ranks that
exchange tokens); `get_tensor_and_data_parallel_group` is a whole stage (expert-bias token counts).

Before `initialize_model_parallel` (or after `destroy_model_parallel`) every getter answers as a
single process (sizes 1, ranks 0, groups None), so the model runs in a plain Python session.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from pretrain.parallel.config import check_expert_divisible, check_world_divisible


@dataclass
class _Layout:
    tp: int
    pp: int
    dp: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_group: object
    dp_group: object
    pp_group: object
    model_group: object  # TP x PP: every rank holding a different piece of one model replica
    embedding_group: object  # first and last stage of this rank's pipeline (None if not in it)
    tp_ranks: list[int]
    dp_ranks: list[int]
    pp_ranks: list[int]
    expert: _ExpertLayout


@dataclass
class _ExpertLayout:
    ep: int
    etp: int
    edp: int
    ep_rank: int
    etp_rank: int
    edp_rank: int
    ep_group: object
    etp_group: object
    edp_group: object
    tp_ep_group: object  # ETP x EP: the ranks that exchange tokens
    stage_group: object  # TP x DP: every rank of this pipeline stage


_LAYOUT: _Layout | None = None


def rank_coordinates(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def global_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """The global rank at coordinates (tp_rank, dp_rank, pp_rank)."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def expert_coordinates(stage_index: int, etp: int, ep: int) -> tuple[int, int, int]:
    """(etp_rank, ep_rank, edp_rank) of the rank at `stage_index` = tp_rank + tp * dp_rank."""
    return stage_index % etp, (stage_index // etp) % ep, stage_index // (etp * ep)


def _make_groups(rank: int, groups: list[list[int]]) -> tuple[object, list[int]]:
    """Create every group (new_group is collective over the whole world); return this rank's."""
    mine, mine_ranks = None, []
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine, mine_ranks = group, ranks
    return mine, mine_ranks


def _groups_along(pp: int, stage: int, etp: int, ep: int, axes: set[int]) -> list[list[int]]:
    """Global ranks that differ only in the expert coordinates `axes` (0 etp, 1 ep, 2 edp), one
    list per stage and combination of the other coordinates, in stage-index order."""
    groups: dict[tuple, list[int]] = {}
    for p in range(pp):
        for i in range(stage):
            coords = expert_coordinates(i, etp, ep)
            key = (p, *(c for axis, c in enumerate(coords) if axis not in axes))
            groups.setdefault(key, []).append(p * stage + i)
    return list(groups.values())


def _expert_layout(rank: int, tp: int, dp: int, pp: int, ep: int, etp: int) -> _ExpertLayout:
    """The expert groups of every stage (see the module docstring), this rank's kept."""
    stage = tp * dp

    def make(axes: set[int]) -> object:
        return _make_groups(rank, _groups_along(pp, stage, etp, ep, axes))[0]

    etp_rank, ep_rank, edp_rank = expert_coordinates(rank % stage, etp, ep)
    return _ExpertLayout(
        ep,
        etp,
        stage // (ep * etp),
        ep_rank,
        etp_rank,
        edp_rank,
        ep_group=make({1}),
        etp_group=make({0}),
        edp_group=make({2}),
        tp_ep_group=make({0, 1}),
        stage_group=make({0, 1, 2}),
    )


def initialize_model_parallel(
    tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None
) -> None:
    """Create the TP, DP, PP, model-parallel and embedding groups, and the expert layers' EP,
    expert-TP (`etp`, None = `tp`, Megatron's default) and expert-DP groups; torch.distributed
    must be up.

    Every rank must call this (group creation is collective), with the same sizes.
    """
    global _LAYOUT
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed.init_process_group first"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world_divisible(world, tp, pp)
    dp = world // (tp * pp)
    etp = tp if etp is None else etp
    check_expert_divisible(tp, dp, ep, etp)
    tp_rank, dp_rank, pp_rank = rank_coordinates(rank, tp, dp)

    def make(groups: list[list[int]]) -> tuple[object, list[int]]:
        return _make_groups(rank, groups)

    tp_group, tp_ranks = make(
        [[global_rank(t, d, p, tp, dp) for t in range(tp)] for p in range(pp) for d in range(dp)]
    )
    dp_group, dp_ranks = make(
        [[global_rank(t, d, p, tp, dp) for d in range(dp)] for p in range(pp) for t in range(tp)]
    )
    pp_groups = [
        [global_rank(t, d, p, tp, dp) for p in range(pp)] for d in range(dp) for t in range(tp)
    ]
    pp_group, pp_ranks = make(pp_groups)
    model_group, _ = make(
        [[global_rank(t, d, p, tp, dp) for p in range(pp) for t in range(tp)] for d in range(dp)]
    )
    embedding_groups = [sorted({ranks[0], ranks[-1]}) for ranks in pp_groups]
    embedding_group, _ = make(embedding_groups)
    _LAYOUT = _Layout(
        tp,
        pp,
        dp,
        tp_rank,
        dp_rank,
        pp_rank,
        tp_group,
        dp_group,
        pp_group,
        model_group,
        embedding_group,
        tp_ranks,
        dp_ranks,
        pp_ranks,
        _expert_layout(rank, tp, dp, pp, ep, etp),
    )


def destroy_model_parallel() -> None:
    """Forget the groups; getters answer as a single process again."""
    global _LAYOUT
    _LAYOUT = None


def model_parallel_is_initialized() -> bool:
    """True between `initialize_model_parallel` and `destroy_model_parallel`."""
    return _LAYOUT is not None


def get_tensor_model_parallel_world_size() -> int:
    """TP size (1 before initialisation)."""
    return _LAYOUT.tp if _LAYOUT else 1


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its TP group."""
    return _LAYOUT.tp_rank if _LAYOUT else 0


def get_tensor_model_parallel_group():
    """This rank's TP process group (None before initialisation)."""
    return _LAYOUT.tp_group if _LAYOUT else None


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return _LAYOUT.tp_ranks[0] if _LAYOUT else 0


def get_data_parallel_world_size() -> int:
    """DP size (1 before initialisation)."""
    return _LAYOUT.dp if _LAYOUT else 1


def get_data_parallel_rank() -> int:
    """This rank's index in its DP group."""
    return _LAYOUT.dp_rank if _LAYOUT else 0


def get_data_parallel_group():
    """This rank's DP process group (None before initialisation)."""
    return _LAYOUT.dp_group if _LAYOUT else None


def get_data_parallel_group_ranks() -> list[int]:
    """Global ranks of this rank's DP group."""
    return list(_LAYOUT.dp_ranks) if _LAYOUT else [0]


def get_pipeline_model_parallel_world_size() -> int:
    """PP size (1 before initialisation)."""
    return _LAYOUT.pp if _LAYOUT else 1


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return _LAYOUT.pp_rank if _LAYOUT else 0


def get_pipeline_model_parallel_group():
    """This rank's PP process group (None before initialisation)."""
    return _LAYOUT.pp_group if _LAYOUT else None


def get_pipeline_model_parallel_ranks() -> list[int]:
    """Global ranks of this rank's pipeline, first stage first."""
    return list(_LAYOUT.pp_ranks) if _LAYOUT else [0]


def get_model_parallel_group():
    """TP x PP group (Megatron's meaning): all ranks that together hold one model replica."""
    return _LAYOUT.model_group if _LAYOUT else None


def get_embedding_group():
    """First and last pipeline stage of this rank's pipeline (one rank when pp == 1)."""
    return _LAYOUT.embedding_group if _LAYOUT else None


def is_pipeline_first_stage() -> bool:
    """True on the stage holding the embedding."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    """True on the stage holding the head and the loss."""
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_expert_model_parallel_world_size() -> int:
    """EP size (1 before initialisation)."""
    return _LAYOUT.expert.ep if _LAYOUT else 1


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its EP group: which slice of the experts it holds."""
    return _LAYOUT.expert.ep_rank if _LAYOUT else 0


def get_expert_model_parallel_group():
    """This rank's EP group (None before initialisation)."""
    return _LAYOUT.expert.ep_group if _LAYOUT else None


def get_expert_tensor_parallel_world_size() -> int:
    """Expert TP size (1 before initialisation)."""
    return _LAYOUT.expert.etp if _LAYOUT else 1


def get_expert_tensor_parallel_rank() -> int:
    """This rank's index in its expert-TP group."""
    return _LAYOUT.expert.etp_rank if _LAYOUT else 0


def get_expert_tensor_parallel_group():
    """This rank's expert-TP group (None before initialisation)."""
    return _LAYOUT.expert.etp_group if _LAYOUT else None


def get_expert_data_parallel_world_size() -> int:
    """Expert DP size: ranks holding the same expert shard (1 before initialisation)."""
    return _LAYOUT.expert.edp if _LAYOUT else 1


def get_expert_data_parallel_group():
    """This rank's expert-DP group: expert gradients are reduced over it."""
    return _LAYOUT.expert.edp_group if _LAYOUT else None


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """ETP x EP: the ranks that exchange tokens (1 before initialisation)."""
    return _LAYOUT.expert.etp * _LAYOUT.expert.ep if _LAYOUT else 1


def get_expert_tensor_and_model_parallel_group():
    """This rank's ETP x EP group (None before initialisation)."""
    return _LAYOUT.expert.tp_ep_group if _LAYOUT else None


def get_tensor_and_data_parallel_group():
    """Every rank of this pipeline stage (TP x DP; None before initialisation)."""
    return _LAYOUT.expert.stage_group if _LAYOUT else None


class DeepSpeedMPU:
    """The `mpu` object `deepspeed.initialize(mpu=...)` expects.

    DeepSpeed's "model parallel" means the tensor-parallel slice: it counts replicated parameters
    once per model-parallel group and shards ZeRO state over the data-parallel group only. DeepSpeed
    is given an mpu only without a pipeline (PipelineModule brings its own grid), where TP x PP == TP,
    so `get_model_parallel_*` answer with the TP group.
    """

    get_model_parallel_rank = staticmethod(get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(get_tensor_model_parallel_group)
    get_tensor_model_parallel_src_rank = staticmethod(get_tensor_model_parallel_src_rank)
    get_data_parallel_rank = staticmethod(get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(get_data_parallel_group)
    get_data_parallel_group_ranks = staticmethod(get_data_parallel_group_ranks)
    get_pipeline_model_parallel_rank = staticmethod(get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(get_pipeline_model_parallel_group)


mpu = DeepSpeedMPU()
