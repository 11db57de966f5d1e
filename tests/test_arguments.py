"""Flags -> typed config: Megatron spellings, Megatron-DeepSpeed aliases, validation with the fix,
the DeepSpeed config, the LR schedule, FLOPs, the log line and launcher detection."""

import dataclasses
import json
import os
import subprocess

import pytest
import torch
from training_fixtures import PYTHON, REPO, make_corpus, model_flags, train_flags
from training_fixtures import test_env as clean_env

from pretrain.cli import parse_args
from pretrain.errors import UserError
from pretrain.launch import detect_launch_env
from pretrain.training.backends.deepspeed.config import build_deepspeed_config
from pretrain.training.report.flops import flops_per_iteration
from pretrain.training.report.logging import IterationStats, format_iteration_line
from pretrain.training.schedules.lr_schedule import LRScheduleConfig, SampleLRScheduler, lr_at
from pretrain.training.schedules.optimizer import param_groups

ONE_RANK = {}  # no launcher variables: one process


def ds_config(cfg):
    """The DeepSpeed config training builds for `cfg` (as pretrain.training.engine calls it)."""
    return build_deepspeed_config(
        global_batch_size=cfg.training.global_batch_size,
        micro_batch_size=cfg.training.micro_batch_size,
        num_microbatches=cfg.training.num_microbatches,
        clip_grad=cfg.optimizer.clip_grad,
        parallel=cfg.parallel,
        precision=cfg.precision,
        user_json=cfg.deepspeed_json,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("args") / "corpus", num_docs=20)


def _args(corpus, *extra, flavour="gpt2"):
    return model_flags(flavour) + train_flags(corpus) + list(extra)


def _world(n):
    return {
        "RANK": "0",
        "WORLD_SIZE": str(n),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }


def test_megatron_deepspeed_aliases(corpus):
    cfg = parse_args(
        _args(
            corpus,
            "--num-key-value-heads",
            "2",
            "--normalization",
            "rmsnorm",
            "--use-rotary-position-embeddings",
            "--zero-stage",
            "1",
            "--deepspeed",
        ),
        env=_world(2),
    )
    assert cfg.model.num_query_groups == 2 and cfg.model.normalization == "RMSNorm"
    assert cfg.model.position_embedding_type == "rope"
    assert cfg.parallel.zero_stage == 1 and cfg.parallel.data_parallel_size == 2
    assert cfg.training.num_microbatches == 8 // (2 * 2)
    assert cfg.model.vocab_size == 101  # NullTokenizer(100) + eod


def test_megatron_gqa_spelling_and_defaults(corpus):
    cfg = parse_args(_args(corpus, "--group-query-attention"), env=ONE_RANK)
    assert cfg.model.num_query_groups == 1  # Megatron: the flag alone means MQA
    cfg = parse_args(_args(corpus), env=ONE_RANK)
    assert cfg.model.num_query_groups is None and cfg.parallel.zero_stage == 0
    assert cfg.schedule.decay_samples == 5 * 8 and cfg.schedule.warmup_samples == 2 * 8


def test_deepspeed_config_consistency(corpus, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 1},
            }
        )
    )
    cfg = parse_args(_args(corpus, "--deepspeed_config", str(ds)), env=ONE_RANK)
    assert cfg.parallel.zero_stage == 1  # taken from the JSON when --zero-stage is absent
    built = ds_config(cfg)
    assert built["gradient_accumulation_steps"] == 4 and built["gradient_clipping"] == 0.05
    for bad, words in (
        ({"train_batch_size": 16}, ["train_batch_size=16", "--global-batch-size is 8"]),
        ({"bf16": {"enabled": True}}, ["bf16.enabled=true", "--bf16 is not given"]),
        ({"zero_optimization": {"stage": 2}}, ["stage=2", "--zero-stage is 1"]),
        ({"optimizer": {"type": "AdamW"}}, ['"optimizer" section']),
    ):
        ds.write_text(json.dumps(bad))
        with pytest.raises(UserError) as err:
            parse_args(
                _args(corpus, "--deepspeed_config", str(ds), "--zero-stage", "1"), env=ONE_RANK
            )
        assert all(w in str(err.value) for w in words), str(err.value)


def _without_batch_flags(corpus, *extra):
    args = _args(corpus, *extra)
    for flag in ("--micro-batch-size", "--global-batch-size"):
        at = args.index(flag)
        del args[at : at + 2]
    return args


@pytest.mark.parametrize(
    "sizes, world, gbs, mbs",
    [
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, 2, 8, 2),
        ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, 2, 8, 2),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2, 12, 2),
        ({"train_batch_size": 8}, 2, 8, 4),  # DeepSpeed: one key alone = 1 accumulation step
        ({"train_micro_batch_size_per_gpu": 3}, 2, 6, 3),
    ],
)
def test_deepspeed_json_supplies_the_batch_sizes_the_flags_leave_out(
    corpus, tmp_path, sizes, world, gbs, mbs
):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(sizes))
    args = _without_batch_flags(corpus, "--deepspeed_config", str(ds))
    cfg = parse_args(args, env=_world(world))
    assert (cfg.training.global_batch_size, cfg.training.micro_batch_size) == (gbs, mbs)
    assert cfg.training.num_microbatches == gbs // (mbs * world)
    built = ds_config(cfg)  # what DeepSpeed gets agrees with every key the JSON set
    assert all(built[key] == value for key, value in sizes.items())


def test_deepspeed_json_batch_sizes_beside_flags(corpus, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    # the flag's global batch and the JSON's accumulation steps give the micro batch
    with_gbs = _without_batch_flags(
        corpus, "--deepspeed_config", str(ds), "--global-batch-size", "8"
    )
    cfg = parse_args(with_gbs, env=ONE_RANK)
    assert (cfg.training.micro_batch_size, cfg.training.num_microbatches) == (4, 2)
    # given flags that disagree with the JSON: the one-line refusal names both
    with pytest.raises(UserError) as err:
        parse_args(_args(corpus, "--deepspeed_config", str(ds)), env=ONE_RANK)  # 8 / 2 = 4 steps
    assert "gradient_accumulation_steps=2 but" in str(err.value) and "is 4" in str(err.value)
    # without a JSON the defaults stay Megatron's: micro batch 1, global batch micro x DP
    cfg = parse_args(_without_batch_flags(corpus), env=_world(2))
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (1, 2)
    for bad, words in (
        ({"train_batch_size": "auto"}, ['train_batch_size="auto": must be a positive integer']),
        ({"train_batch_size": 9, "gradient_accumulation_steps": 2}, ["9 is not divisible"]),
    ):
        ds.write_text(json.dumps(bad))
        with pytest.raises(UserError) as err:
            parse_args(_without_batch_flags(corpus, "--deepspeed_config", str(ds)), env=ONE_RANK)
        assert all(w in str(err.value) for w in words), str(err.value)


def test_deepspeed_config_from_flags(corpus):
    zero0 = ds_config(parse_args(_args(corpus), env=ONE_RANK))
    assert zero0["gradient_clipping"] == 0.0  # our optimizer clips with the true norm
    assert zero0["zero_optimization"]["stage"] == 0 and zero0["train_batch_size"] == 8
    bf16 = ds_config(
        parse_args(_args(corpus, "--bf16", "--zero-stage", "2", "--cpu-offload"), env=ONE_RANK)
    )
    assert bf16["bf16"] == {"enabled": True} and bf16["gradient_clipping"] == 0.05
    assert bf16["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    cfg = parse_args(_args(corpus), env=ONE_RANK)
    fp16 = ds_config(
        dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, fp16=True))
    )
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["initial_scale_power"] == 32
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--fp16 needs a GPU"):
            parse_args(_args(corpus, "--fp16"), env=ONE_RANK)


def test_lr_schedule_in_samples():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_samples=10, decay_samples=110, warmup_init=0.0)
    assert lr_at(0, style="cosine", **kw) == 0.0
    assert lr_at(5, style="cosine", **kw) == 0.5
    # halfway: cos(pi/2) = 0
    assert lr_at(60, style="cosine", **kw) == pytest.approx(0.1 + 0.5 * 0.9)
    assert lr_at(60, style="linear", **kw) == pytest.approx(0.55)
    assert lr_at(200, style="linear", **kw) == 0.1
    assert lr_at(200, style="constant", **kw) == 1.0
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    schedule = LRScheduleConfig(
        lr=1.0, min_lr=0.1, warmup_samples=10, decay_samples=110, decay_style="linear"
    )
    sched = SampleLRScheduler(opt, schedule, global_batch_size=5)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    state = sched.state_dict()
    other = SampleLRScheduler(opt, schedule, global_batch_size=5)
    other.load_state_dict(state)
    assert other.num_samples == 5 and opt.param_groups[0]["lr"] == 0.5


def test_flops_match_megatron_worked_example():
    from pretrain.model.config import ModelConfig

    gpt2 = ModelConfig(
        num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257, seq_length=1024
    )
    per_token = flops_per_iteration(gpt2, 1, 50304) / 1024
    # 72 L h^2 + 6 L h s + 6 h V, by hand (spec: 0.798 GFLOP/token)
    assert per_token == 72 * 12 * 768**2 + 6 * 12 * 768 * 1024 + 6 * 768 * 50304
    assert round(per_token / 1e9, 3) == 0.798


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model.named_parameters(), 0.1)
    assert [p.shape for p in decay["params"]] == [(4, 4)] and decay["weight_decay"] == 0.1
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_megatron_log_line():
    line = format_iteration_line(
        IterationStats(
            iteration=5,
            train_iters=100,
            consumed_samples=40,
            elapsed_ms=123.45,
            learning_rate=3e-4,
            global_batch_size=8,
            lm_loss=1.2345678,
            loss_scale=1.0,
            grad_norm=0.5,
            skipped_iterations=0,
            nan_iterations=0,
            tokens_per_second=1000.0,
            tflops_per_device=1.5,
            mfu=0.25,
        )
    )
    assert line == (
        " iteration        5/     100 | consumed samples:           40 | elapsed time per iteration (ms):"
        " 123.5 | throughput per GPU (TFLOP/s/GPU): 1.500 | learning rate: 3.000000E-04 | global batch"
        " size:     8 | lm loss: 1.234568E+00 | loss scale: 1.0 | grad norm: 0.500 | number of skipped"
        " iterations:   0 | number of nan iterations:   0 | tokens per second: 1000.0 | MFU: 25.00% |"
    )


def test_launcher_detection():
    slurm = detect_launch_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS_PER_NODE": "4(x2)",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "1234",
        }
    )
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.local_world_size) == (5, 8, 1, 4)
    assert (slurm.master_addr, slurm.master_port, slurm.launcher) == ("gpu07", 21234, "slurm")
    ds = detect_launch_env(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (ds.rank, ds.local_world_size, ds.launcher) == (1, 2, "deepspeed")
    plain = detect_launch_env({})
    assert (plain.rank, plain.world_size, plain.launcher) == (
        0,
        1,
        "python",
    ) and plain.master_port > 0


CLI_ERRORS = [  # (extra flags, world size, words the one-line error must contain)
    (
        ["--tensor-model-parallel-size", "2"],
        3,
        ["world size 3 is not divisible", "--tensor-model-parallel-size 2"],
    ),
    (
        ["--global-batch-size", "6", "--micro-batch-size", "4"],
        1,
        ["--global-batch-size 6 is not divisible by --micro-batch-size 4"],
    ),
    (
        ["--num-attention-heads", "6", "--hidden-size", "36", "--tensor-model-parallel-size", "4"],
        4,
        ["--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"],
    ),
    (
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
        2,
        ["--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"],
    ),
    (
        ["--pipeline-model-parallel-size", "2", "--zero-stage", "2"],
        2,
        ["--zero-stage 2", "ZeRO 0 and 1 only"],
    ),
    (["--deepspeed_config", "DSJSON"], 1, ["train_batch_size=64", "--global-batch-size is 8"]),
    (["--data-path", "/nonexistent/corpus"], 1, ["/nonexistent/corpus.bin does not exist"]),
    (
        [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "/nonexistent/vocab.json",
            "--merge-file",
            "/nonexistent/merges.txt",
        ],
        1,
        ["/nonexistent/vocab.json"],
    ),
    (["--batch-size", "4"], 1, ["--batch-size", "use --micro-batch-size"]),
]


@pytest.mark.slow  # an end-to-end run over 5 s: not in `make test-fast`
def test_validation_errors_through_the_real_cli(corpus, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 64}))
    procs = []
    for extra, world, words in CLI_ERRORS:
        extra = [str(ds) if a == "DSJSON" else a for a in extra]
        env = clean_env(**(_world(world) if world > 1 else {}))
        procs.append(
            (
                subprocess.Popen(
                    [PYTHON, str(REPO / "pretrain_gpt.py"), *_args(corpus), *extra],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
                words,
            )
        )
    for proc, words in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (words, out[-2000:], err[-2000:])
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert all(w in lines[0] for w in words), lines[0]


def test_cpu_threads_default_to_cores_per_rank():
    from pretrain.launch import LaunchEnv
    from pretrain.training.distributed import default_threads_per_rank, prepare_process_environment

    before = torch.get_num_threads()
    env = {}
    try:
        prepare_process_environment(
            LaunchEnv(
                rank=1,
                world_size=4,
                local_rank=1,
                local_world_size=4,
                master_addr="127.0.0.1",
                master_port=29500,
                launcher="deepspeed",
            ),
            env,
        )
    finally:
        torch.set_num_threads(before)
    cores = len(os.sched_getaffinity(0))
    assert env["OMP_NUM_THREADS"] == str(max(1, cores // 4)) == str(default_threads_per_rank(4))
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "4", "1")
    kept = {"OMP_NUM_THREADS": "3"}
    try:
        prepare_process_environment(
            LaunchEnv(
                rank=0,
                world_size=1,
                local_rank=0,
                local_world_size=1,
                master_addr="127.0.0.1",
                master_port=29500,
                launcher="python",
            ),
            kept,
        )
    finally:
        torch.set_num_threads(before)
    assert kept["OMP_NUM_THREADS"] == "3"  # a user's setting wins


def test_megatron_script_flags_are_accepted_with_their_meaning(corpus):
    compat = [
        "--use-flash-attn",
        "--use-mcore-models",
        "--data-impl",
        "mmap",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-swiglu-fusion",
        "--no-bias-dropout-fusion",
        "--no-rope-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm",
    ]
    assert parse_args(_args(corpus, *compat), env=ONE_RANK).parallel.zero_stage == 0
    # Megatron's distributed optimizer shards the optimizer state over DP: ZeRO-1
    dist_opt = parse_args(_args(corpus, "--use-distributed-optimizer"), env=_world(2))
    assert dist_opt.parallel.zero_stage == 1
    more = _args(corpus, "--use-distributed-optimizer", "--zero-stage", "2")
    assert parse_args(more, env=_world(2)).parallel.zero_stage == 2
    with pytest.raises(UserError, match="--use-distributed-optimizer .* --zero-stage is 0"):
        parse_args(_args(corpus, "--use-distributed-optimizer", "--zero-stage", "0"), env=ONE_RANK)
    with pytest.raises(UserError, match="--data-impl: invalid choice: 'lazy'"):
        parse_args(_args(corpus, "--data-impl", "lazy"), env=ONE_RANK)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--num-key-value-heads", "2", "--group-query-attention", "--num-query-groups", "1"],
         ["--num-key-value-heads 2 disagrees", "--num-query-groups 1"]),
        (["--num-query-groups", "2"], ["--num-query-groups 2 has no effect without --group-query-attention"]),
        (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
         ["--use-rotary-position-embeddings contradicts --position-embedding-type learned_absolute"]),
    ],
)  # fmt: skip
def test_two_spellings_that_disagree_are_refused(corpus, extra, words):
    with pytest.raises(UserError) as err:
        parse_args(_args(corpus, *extra), env=ONE_RANK)
    assert all(w in str(err.value) for w in words), str(err.value)
    same = ["--num-key-value-heads", "2", "--group-query-attention", "--num-query-groups", "2"]
    assert parse_args(_args(corpus, *same), env=ONE_RANK).model.num_query_groups == 2


def test_fp16_loss_scale_flags_and_deepspeed_json_must_agree():
    from pretrain.training.backends.deepspeed.config import check_user_config
    from pretrain.training.precision import PrecisionConfig

    sizes = dict(global_batch_size=8, micro_batch_size=2, data_parallel_size=1, clip_grad=1.0)
    fp16 = PrecisionConfig(fp16=True, loss_scale_window=500)
    ds = {"fp16": {"enabled": True, "loss_scale_window": 1000}}
    with pytest.raises(UserError) as err:
        check_user_config(ds, "ds.json", precision=fp16, zero_stage_flag=None, **sizes)
    assert "fp16.loss_scale_window=1000 but --loss-scale-window is 500" in str(err.value)
    agree = {"fp16": {"enabled": True, "loss_scale_window": 500, "initial_scale_power": 32}}
    assert check_user_config(agree, "ds.json", precision=fp16, zero_stage_flag=None, **sizes) == 0


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_model_flags_rebuild_the_same_model_through_the_cli(corpus, flavour):
    """One field<->flag mapping: the flags model_flags() prints for a config parse back to it."""
    from pretrain.model.config import model_flags as flags_of

    cfg = parse_args(_args(corpus, flavour=flavour), env=ONE_RANK)
    rebuilt = parse_args(flags_of(cfg.model) + train_flags(corpus), env=ONE_RANK).model
    assert rebuilt == cfg.model
    scaled = dataclasses.replace(cfg.model, position_embedding_type="rope", use_rope_scaling=True)
    scaled = dataclasses.replace(scaled, rope_scaling_factor=16.0, openai_gelu=True)
    assert parse_args(flags_of(scaled) + train_flags(corpus), env=ONE_RANK).model == scaled
