"""The flags of the torch backend (`--use-torch-fsdp2`), checked before launch.

FSDP2 is torch's ZeRO-3: it always shards parameters, gradients and optimizer state over the
data-parallel ranks, so DeepSpeed's ZeRO flags and JSON have nothing to set and are refused by
name. Its one offload policy (`CPUOffloadPolicy`) keeps parameters, gradients and the optimizer
step in CPU memory together: any of DeepSpeed's CPU offload flags turns it on; NVMe has no
equivalent. `--async-save` and `--ckpt-format torch_dist` (DCP) are this backend's only.
"""

from __future__ import annotations

from pretrain.errors import UserError

CKPT_FORMAT = "torch_dist"
"""The `--ckpt-format` of this backend: torch.distributed.checkpoint (DCP) folders."""


def check_deepspeed_only(*, async_save: bool, ckpt_format: str | None) -> None:
    """Refuse, in one line, a torch-backend flag without `--use-torch-fsdp2`."""
    if async_save:
        raise UserError(
            "--async-save: background checkpoint writes are the torch backend's (DCP, --ckpt-format "
            "torch_dist); add --use-torch-fsdp2, or drop --async-save (DeepSpeed saves block)"
        )
    if ckpt_format == CKPT_FORMAT:
        raise UserError(
            f"--ckpt-format {CKPT_FORMAT}: DCP checkpoints are written by the torch backend; add "
            f"--use-torch-fsdp2, or use --ckpt-format torch (DeepSpeed's files)"
        )


def resolve_torch_flags(
    *,
    zero_stage: int | None,
    use_distributed_optimizer: bool,
    deepspeed_config: str | None,
    cpu_offload: bool,
    offload_optimizer: str | None,
    offload_param: str | None,
    fp16: bool,
    ckpt_format: str | None,
) -> dict:
    """The ParallelConfig offload fields of a `--use-torch-fsdp2` run (both "cpu" when any CPU
    offload flag is given: FSDP2 offloads parameters, gradients and optimizer step together);
    a flag the backend cannot honour is one UserError naming it and the fix."""
    given = [
        f"--zero-stage {zero_stage}" if zero_stage is not None else None,
        "--use-distributed-optimizer" if use_distributed_optimizer else None,
        f"--deepspeed_config {deepspeed_config}" if deepspeed_config else None,
    ]
    given = [g for g in given if g]
    if given:
        raise UserError(
            f"{given[0]} with --use-torch-fsdp2: FSDP2 always shards parameters, gradients and "
            f"optimizer state over the data-parallel ranks (ZeRO-3's sharding); drop "
            f"{given[0].split()[0]}, or drop --use-torch-fsdp2 to train with DeepSpeed"
        )
    if fp16:
        raise UserError(
            "--fp16 with --use-torch-fsdp2: the torch backend has no loss scaling; use --bf16"
        )
    if ckpt_format not in (None, CKPT_FORMAT):
        raise UserError(
            f"--ckpt-format {ckpt_format} with --use-torch-fsdp2: the torch backend writes "
            f"torch.distributed.checkpoint folders (--ckpt-format {CKPT_FORMAT}); use it or drop "
            f"the flag"
        )
    for flag, value in (
        ("--offload-optimizer", offload_optimizer),
        ("--offload-param", offload_param),
    ):
        if value == "nvme":
            raise UserError(
                f"{flag} nvme with --use-torch-fsdp2: FSDP2 offloads to CPU memory only; use "
                f"{flag} cpu, or DeepSpeed (drop --use-torch-fsdp2) for ZeRO-Infinity's NVMe"
            )
    on = cpu_offload or "cpu" in (offload_optimizer, offload_param)
    where = "cpu" if on else None
    return {"offload_optimizer": where, "offload_param": where, "offload_nvme_path": None}
