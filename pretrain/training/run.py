"""`pretrain(argv)`: flags -> process group -> engine -> checkpoint -> data -> loop -> final save."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch

from pretrain.arguments import Config, parse_args
from pretrain.data.builder import build_train_valid_test_datasets
from pretrain.data.config import train_valid_test_num_samples
from pretrain.data.samplers import build_pretraining_data_loader
from pretrain.parallel import state
from pretrain.tokenizer import build_tokenizer
from pretrain.training.checkpointing import (
    TrainState,
    check_before_launch,
    load_checkpoint,
    restore_rng_state,
)
from pretrain.training.distributed import (
    choose_backend,
    init_distributed,
    prepare_process_environment,
)
from pretrain.training.logging import banner, logger, setup_logging


def _data_iterators(
    cfg: Config, consumed_train: int, consumed_valid: int, use_mask: bool, device: torch.device
):
    """(train batches, valid batches or None), positioned after the consumed samples."""
    from pretrain.training.loop import PipelineBatches  # imports deepspeed (see pretrain())

    t = cfg.training
    num_samples = train_valid_test_num_samples(
        t.train_iters, t.train_samples, t.eval_interval, t.eval_iters, t.global_batch_size
    )
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        cfg.data, build_tokenizer(cfg.tokenizer), num_samples
    )
    dp_rank, dp = state.get_data_parallel_rank(), state.get_data_parallel_world_size()

    def batches(dataset, consumed):
        loader = build_pretraining_data_loader(
            dataset, consumed, t.micro_batch_size, dp_rank, dp, cfg.data
        )
        it = iter(loader)
        return (
            PipelineBatches(it, use_mask, device)
            if cfg.parallel.pipeline_model_parallel_size > 1
            else it
        )

    valid = None if valid_ds is None or t.eval_iters == 0 else batches(valid_ds, consumed_valid)
    return batches(train_ds, consumed_train), valid


def pretrain(argv: Sequence[str]) -> None:
    cfg = parse_args(argv)
    if cfg.checkpoint.load:
        check_before_launch(cfg)
    prepare_process_environment(cfg.launch)
    setup_logging(cfg.launch.rank)
    backend = choose_backend(cfg.parallel.distributed_backend)
    owns_process_group = not torch.distributed.is_initialized()
    device = init_distributed(cfg.launch, backend, cfg.parallel.distributed_timeout_minutes)

    # DeepSpeed broadcasts the tied embedding through autograd once at start-up; harmless.
    warnings.filterwarnings(
        "ignore", message="c10d::broadcast_: an autograd kernel was not registered"
    )
    # DeepSpeed's pipeline engine partitions activations with a torch collective torch has renamed.
    warnings.filterwarnings(
        "ignore", message=".*all_gather_into_tensor` is deprecated", category=FutureWarning
    )
    # DeepSpeed picks its accelerator when first imported: only after the environment is set.
    from pretrain.training.engine import build_engine
    from pretrain.training.flops import flops_per_iteration, peak_tflops_per_device
    from pretrain.training.logging import ScalarWriter
    from pretrain.training.loop import Throughput, train

    t, par = cfg.training, cfg.parallel
    engine = build_engine(cfg)
    ts, rng = load_checkpoint(cfg, engine) if cfg.checkpoint.load else (TrainState(), None)
    # The causal mask is built into attention; a mask tensor is only needed when documents are
    # kept apart (--reset-attention-mask).
    use_mask = cfg.data.reset_attention_mask
    train_batches, valid_batches = _data_iterators(
        cfg, ts.consumed_train_samples, ts.consumed_valid_samples, use_mask, device
    )
    if rng is not None:  # last: creating the loaders above draws from the torch generator
        restore_rng_state(rng)

    flops = flops_per_iteration(cfg.model, t.global_batch_size, engine.padded_vocab_size)
    precision = "bf16" if t.bf16 else ("fp16" if t.fp16 else "fp32")
    logger.info(
        banner(
            tp=par.tensor_model_parallel_size,
            pp=par.pipeline_model_parallel_size,
            dp=par.data_parallel_size,
            zero=par.zero_stage,
            world=par.world_size,
            launcher=cfg.launch.launcher,
            backend=backend,
            device=str(device),
            params_total=engine.params_total,
            tokens_per_iteration=t.global_batch_size * t.seq_length,
            global_batch=t.global_batch_size,
            micro_batch=t.micro_batch_size,
            num_microbatches=t.num_microbatches,
            precision=precision,
            save=cfg.checkpoint.save,
            load=cfg.checkpoint.load,
            flops_per_iteration=flops,
            threads=torch.get_num_threads(),
        )
    )
    if ts.iteration >= t.train_iters:
        logger.info(
            f"checkpoint is at iteration {ts.iteration} >= --train-iters {t.train_iters}: nothing to do"
        )
    writer = ScalarWriter(
        cfg.launch.rank,
        cfg.logging.tensorboard_dir,
        cfg.logging.wandb_project,
        cfg.logging.wandb_exp_name,
        cfg.logging.metrics_file,
        {"argv": list(cfg.argv)},
    )
    throughput = Throughput(
        t.global_batch_size * t.seq_length,
        flops,
        par.world_size,
        peak_tflops_per_device(cfg.logging.peak_tflops),
    )
    try:
        train(cfg, engine, ts, train_batches, valid_batches, writer, throughput, use_mask, device)
    finally:
        writer.close()
    torch.distributed.barrier()
    engine.ds.destroy()
    state.destroy_model_parallel()
    if owns_process_group:  # a caller that brought its own group may run again in this process
        torch.distributed.destroy_process_group()
    logger.info(
        f"done: {ts.iteration} iterations, {ts.consumed_train_samples} samples"
        + (
            f"; checkpoints in {os.path.abspath(cfg.checkpoint.save)}"
            if cfg.checkpoint.save
            else ""
        )
    )
