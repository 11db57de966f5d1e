"""DeepSpeed's ZeRO-Offload and ZeRO-Infinity: which state goes to CPU memory or to an NVMe folder.

The flags (`--cpu-offload`, `--offload-optimizer`, `--offload-param`, `--offload-nvme-path`) and
a `--deepspeed_config` JSON's `zero_optimization.offload_optimizer` / `offload_param` sections
resolve here into ParallelConfig's offload fields, checked once: a JSON value the flags do not
set is kept, a flag that contradicts the JSON is refused in one line. `zero_sections` writes the result back into the
DeepSpeed config, keeping the JSON's other keys (pin_memory, buffer_count, ...).

Facts of DeepSpeed 0.19 this relies on (docs/TRAINING.md, "Offload"):
- ZeRO-1/2 treat any offload_optimizer device other than "none" as CPU memory (they have no NVMe
  path), so NVMe is refused below ZeRO-3; offload_param exists at ZeRO-3 only.
- Offload keeps our optimizer (torch AdamW over Megatron's groups) when
  `zero_force_ds_cpu_optimizer` is false; otherwise DeepSpeed refuses any optimizer but its own
  DeepSpeedCPUAdam.
- NVMe offload swaps through DeepSpeed's `async_io` op (JIT-built, needs libaio).
"""

from __future__ import annotations

import os
import tempfile

import deepspeed

from pretrain.errors import UserError
from pretrain.parallel.config import ParallelConfig

DEVICES = ("cpu", "nvme")


def _json_device(zero: dict, key: str, path: str | None) -> str | None:
    """The device a JSON `zero_optimization.<key>` section names: "none" when it says so."""
    section = zero.get(key)
    if section is None:
        return None
    device = section.get("device", "none") if isinstance(section, dict) else section
    if not isinstance(section, dict) or device not in ("none", *DEVICES):
        raise UserError(
            f"--deepspeed_config {path} sets zero_optimization.{key} to {section!r}: DeepSpeed "
            f'wants {{"device": "none" | "cpu" | "nvme", ...}} (fix the value)'
        )
    ratio = section.get("ratio", 1.0)
    if key == "offload_optimizer" and device != "none" and ratio != 1.0:
        raise UserError(
            f"--deepspeed_config {path} sets zero_optimization.offload_optimizer.ratio={ratio}: "
            f"partial offload is DeepSpeed's hybrid optimizer, which needs its DeepSpeedCPUAdam; "
            f"the optimizer here is ours, torch AdamW (remove the ratio key: all state offloaded)"
        )
    return device


def _merge(flag: str, flag_value: str | None, key: str, zero: dict, path: str | None):
    """The flag's device, else the JSON's (None for "none"); a contradicting flag is refused."""
    json_value = _json_device(zero, key, path)
    if flag_value is not None and json_value is not None and json_value != flag_value:
        raise UserError(
            f"--deepspeed_config {path} sets zero_optimization.{key}.device={json_value} but "
            f"{flag} is {flag_value} (make them agree, or drop the key from the JSON)"
        )
    device = flag_value if flag_value is not None else json_value
    return None if device == "none" else device


def resolve_offload(
    *,
    cpu_offload: bool,
    optimizer: str | None,
    param: str | None,
    nvme_path: str | None,
    zero_stage: int,
    user_json: dict | None = None,
    json_path: str | None = None,
) -> dict:
    """The checked offload of this run, from the flags and the user's DeepSpeed JSON: the
    ParallelConfig fields offload_optimizer, offload_param and offload_nvme_path."""
    if cpu_offload and optimizer not in (None, "cpu"):
        raise UserError(
            f"--cpu-offload and --offload-optimizer {optimizer} disagree (give one of them)"
        )
    opt_flag = "--cpu-offload" if cpu_offload else "--offload-optimizer"
    zero = (user_json or {}).get("zero_optimization", {})
    optimizer = _merge(
        opt_flag, "cpu" if cpu_offload else optimizer, "offload_optimizer", zero, json_path
    )
    param = _merge("--offload-param", param, "offload_param", zero, json_path)
    json_paths = {
        key: str(zero[key]["nvme_path"])
        for key, device in (("offload_optimizer", optimizer), ("offload_param", param))
        if device == "nvme" and (zero.get(key) or {}).get("nvme_path") is not None
    }  # a flag's device "nvme" beside a JSON section: the section's path is used
    for key, json_nvme in json_paths.items():
        if nvme_path is not None and json_nvme != nvme_path:
            raise UserError(
                f"--deepspeed_config {json_path} sets zero_optimization.{key}.nvme_path="
                f"{json_nvme} but --offload-nvme-path is {nvme_path} (make them agree, or drop "
                f"the key from the JSON)"
            )
        _check_folder(
            json_nvme, f"--deepspeed_config {json_path}: zero_optimization.{key}.nvme_path"
        )
    if nvme_path is None and json_paths:
        nvme_path = next(iter(json_paths.values()))
    _check(optimizer, param, nvme_path, zero_stage, opt_flag)
    return dict(offload_optimizer=optimizer, offload_param=param, offload_nvme_path=nvme_path)


def _check(optimizer, param, nvme_path, zero_stage: int, opt_flag: str) -> None:
    """One-line refusals for what DeepSpeed cannot do with this ZeRO stage or folder."""
    if optimizer and zero_stage == 0:
        raise UserError(f"{opt_flag} needs ZeRO (add --zero-stage 1, 2 or 3)")
    if param and zero_stage != 3:
        raise UserError(
            f"--offload-param {param} needs --zero-stage 3 (only ZeRO-3 partitions the "
            f"parameters; this run uses ZeRO-{zero_stage})"
        )
    if optimizer == "nvme" and zero_stage != 3:
        raise UserError(
            f"--offload-optimizer nvme needs --zero-stage 3 (ZeRO-Infinity; DeepSpeed's ZeRO-"
            f"{zero_stage} keeps offloaded optimizer state in CPU memory: use --cpu-offload)"
        )
    nvme = "nvme" in (optimizer, param)
    if nvme and nvme_path is None:
        raise UserError(
            "NVMe offload needs --offload-nvme-path DIR (a folder on a fast local disk)"
        )
    if not nvme and nvme_path is not None:
        raise UserError(
            f"--offload-nvme-path {nvme_path} is only used with --offload-optimizer nvme "
            f"or --offload-param nvme (add one, or drop the path)"
        )
    if nvme:
        _check_folder(nvme_path, "--offload-nvme-path")
        _check_async_io()


def check_nvme_checkpoints(parallel: ParallelConfig, *, save: str | None, load: str | None) -> None:
    """Refuse --save/--load beside NVMe optimizer offload (one line): DeepSpeed 0.19's checkpoint
    of it resumes wrongly (measured in docs/TRAINING.md, "Offload"; NVMe parameters resume)."""
    given = [f"{flag} {path}" for flag, path in (("--save", save), ("--load", load)) if path]
    if parallel.offload_optimizer == "nvme" and given:
        raise UserError(
            f"{' and '.join(given)} with --offload-optimizer nvme: DeepSpeed 0.19's checkpoints "
            f"of NVMe-offloaded optimizer state do not resume correctly (use --cpu-offload, "
            f"optionally with --offload-param nvme, whose checkpoints resume; or drop "
            f"--save/--load)"
        )


def _check_async_io() -> None:
    """Refuse (one line) NVMe offload where DeepSpeed's async_io op cannot build (no libaio)."""
    from deepspeed.accelerator import get_accelerator  # only for NVMe: parsing stays light

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        raise UserError(
            f"NVMe offload needs DeepSpeed's async_io op, which cannot be built on this machine "
            f"({get_accelerator().device_name()} accelerator; install libaio: apt-get install "
            f"libaio-dev), or offload to cpu instead"
        )


def _check_folder(path: str, where: str) -> None:
    """Refuse (one line naming `where`, the flag or JSON key) a missing or unwritable folder."""
    if not os.path.isdir(path):
        raise UserError(f"{where} {path}: no such folder (create it on a fast local disk)")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise UserError(
            f"{where} {path}: cannot write there ({err.strerror}; give a folder "
            f"this user can write)"
        ) from None


def zero_sections(zero: dict, parallel: ParallelConfig) -> None:
    """Write the offload into DeepSpeed's `zero_optimization` dict, keeping the JSON's other keys."""
    for key, device in (
        ("offload_optimizer", parallel.offload_optimizer),
        ("offload_param", parallel.offload_param),
    ):
        if device is None:
            continue
        section = dict(zero.get(key) or {})
        section["device"] = device
        section.setdefault("pin_memory", False)
        if device == "nvme":
            section.setdefault(
                "nvme_path", parallel.offload_nvme_path
            )  # the JSON's agrees (checked)
        zero[key] = section


def partition_nvme_parameters(model, ds_config: dict, mpu) -> None:
    """ZeRO-3 with NVMe parameters: partition `model` with `deepspeed.zero.Init` before
    `deepspeed.initialize`, its dtype taken from the config (fp32, bf16 or fp16).

    DeepSpeed's own conversion passes the model's dtype to `Init`, which ignores it on an
    accelerator without fp16 support (a CPU without AVX512-FP16: it falls back to bf16), so the
    parameter swapper keeps bf16 buffers and every swapped weight is rounded to bf16 (measured in
    fp32: the 4 MiB matrices 2.4e-4 off after the first swap, the first loss 2e-5 relative off).
    Parameters already partitioned are left alone by DeepSpeed's engine."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage") != 3 or (zero.get("offload_param") or {}).get("device") != "nvme":
        return
    deepspeed.zero.Init(
        module=model,
        data_parallel_group=mpu.get_data_parallel_group(),
        config_dict_or_path=ds_config,
        mpu=mpu,
    )
