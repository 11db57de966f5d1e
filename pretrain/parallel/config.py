"""`ParallelConfig`: how the ranks of a job split into tensor, pipeline and data parallelism.

The one place that checks that a world size splits into TP x PP x DP, and a pipeline stage's
ranks into the expert layers' ETP x EP x EDP; the argument parser, `initialize_model_parallel` and
the tests all go through `check_world_divisible` and `check_expert_divisible`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.errors import UserError


def check_world_divisible(world_size: int, tp: int, pp: int) -> None:
    """Raise a UserError unless `world_size` splits into tp x pp x dp."""
    if tp < 1 or pp < 1:
        raise UserError(
            f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must "
            f"be >= 1"
        )
    if world_size % (tp * pp) != 0:
        raise UserError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp} (launch a multiple of {tp * pp} "
            f"ranks, or change the parallel sizes)"
        )


def check_expert_divisible(tp: int, dp: int, ep: int, etp: int) -> None:
    """Raise a UserError unless a pipeline stage's tp x dp ranks split into etp x ep x edp (the
    expert layers' layout, Megatron's: EP and expert TP re-cut the same ranks)."""
    if ep < 1 or etp < 1:
        raise UserError(
            f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must "
            f"be >= 1"
        )
    if (tp * dp) % (ep * etp) != 0:
        raise UserError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} "
            f"does not divide the {tp * dp} ranks of a pipeline stage (--tensor-model-parallel-size "
            f"{tp} x data-parallel size {dp}); choose sizes whose product divides {tp * dp}"
        )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel layout of one run; checked on construction."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that split every layer's weights."""
    pipeline_model_parallel_size: int = 1
    """PP: ranks that each hold a contiguous block of layers."""
    world_size: int = 1
    """Ranks in the job; DP = world / (TP x PP)."""
    expert_model_parallel_size: int = 1
    """EP: ranks of a pipeline stage that split the experts of every MoE layer."""
    expert_tensor_parallel_size: int | None = None
    """Expert TP: ranks that split each expert's weights; None = the tensor-parallel size
    (Megatron's default)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (0-3), sharding over the data-parallel ranks."""
    use_torch_fsdp2: bool = False
    """The torch-native backend: FSDP2 shards parameters, gradients and optimizer state over the
    data-parallel ranks per transformer layer (--use-torch-fsdp2); False: DeepSpeed."""
    pipeline_schedule: str = "1f1b"
    """The pipeline schedule (--pipeline-schedule): "1f1b" (DeepSpeed's pipeline engine runs it;
    so does the torch backend), or, on the torch backend, "interleaved-1f1b",
    "interleaved-zero-bubble", "zbv-zero-bubble"."""
    virtual_pipeline_stages: int = 1
    """Model chunks per pipeline rank, Megatron's virtual pipeline size
    (--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank)."""
    offload_optimizer: str | None = None
    """ZeRO-Offload: "cpu" or "nvme" (ZeRO-3) keeps the optimizer state and step there; None:
    device memory (--offload-optimizer, --cpu-offload; pretrain/training/backends/deepspeed/offload.py checks it)."""
    offload_param: str | None = None
    """ZeRO-3 parameter offload: "cpu" or "nvme" (--offload-param)."""
    offload_nvme_path: str | None = None
    """The folder NVMe offload swaps to (--offload-nvme-path)."""
    overlap_grad_reduce: bool = False
    """Overlap the ZeRO-1/2 gradient reduction with backward: DeepSpeed's `overlap_comm`
    (--overlap-grad-reduce)."""
    distributed_backend: str | None = None
    """"nccl" or "gloo"; None picks nccl with GPUs, gloo without."""
    distributed_timeout_minutes: float = 10.0
    """Collectives that wait longer than this fail instead of hanging."""

    def __post_init__(self) -> None:
        check_world_divisible(
            self.world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        )
        check_expert_divisible(
            self.tensor_model_parallel_size,
            self.data_parallel_size,
            self.expert_model_parallel_size,
            self.expert_tp,
        )

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size, resolved (None means the tensor-parallel size)."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    @property
    def backend(self) -> str:
        """The training backend: "torch" (FSDP2, --use-torch-fsdp2) or "deepspeed"."""
        return "torch" if self.use_torch_fsdp2 else "deepspeed"

    @property
    def data_parallel_size(self) -> int:
        """DP: model replicas, each fed its own slice of every global batch."""
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )
