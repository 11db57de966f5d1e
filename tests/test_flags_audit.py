"""Every flag `pretrain_gpt.py --help` lists changes the run, or its help says it does not.

The flags are read from the real `--help` output. A flag whose help starts with "no-op" or
"accepted" must leave the parsed `RunConfig` exactly as it is without it; every other flag must
change it (a config field, or a value the resolvers derive), shown by parsing a tiny command
line with and without it. `CHANGES` holds the value (and, where needed, the context) each flag
is tried with; it must name exactly the flags that `--help` lists as not no-ops, so a new flag
without an entry, or a no-op without "no-op"/"accepted" in its help, fails here.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
from tokenizer_fixtures import CL100K, MERGES, VOCAB
from training_fixtures import PYTHON, REPO, make_corpus
from training_fixtures import test_env as clean_env  # (pytest would collect test_env)

from pretrain.cli import build_parser, parse_args
from pretrain.errors import UserError

NOOP_HELP = re.compile(r"^(no-op|accepted)\b")
ITERS = ["--train-iters", "4"]
ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
TWO_RANKS = {**ONE_RANK, "WORLD_SIZE": "2"}


@pytest.fixture(scope="module")
def help_flags() -> dict[str, str]:
    """{option string: its help text} for every option `pretrain_gpt.py --help` prints."""
    out = subprocess.run(
        [PYTHON, str(REPO / "pretrain_gpt.py"), "--help"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"^  (-[-\w]+)", out.stdout, re.MULTILINE))
    listed |= set(re.findall(r", (--[-\w]+)", out.stdout))  # aliases after the first spelling
    listed -= {"-h", "--help"}
    actions = build_parser()._option_string_actions  # argparse's own index of the options
    assert listed <= set(actions), listed - set(actions)
    return {flag: actions[flag].help or "" for flag in sorted(listed)}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Data prefixes, tokenizer files and JSON inputs the flags point at."""
    tmp = tmp_path_factory.mktemp("audit")
    corpus, other = make_corpus(tmp / "corpus"), make_corpus(tmp / "other", seed=1)
    for name, src in (("vocab2.json", VOCAB), ("merges2.txt", MERGES)):
        shutil.copyfile(src, tmp / name)
    tok = tmp / "hf"
    tok.mkdir()
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(100)} | {"</s>": 100}  # covers the corpus' ids
    Tokenizer(models.WordLevel(vocab, unk_token="</s>")).save(str(tok / "a.json"))
    shutil.copyfile(tok / "a.json", tok / "b.json")
    (tmp / "args.txt").write_text(other)
    (tmp / "splits.json").write_text(json.dumps({"train": other, "valid": other, "test": other}))
    (tmp / "ds.json").write_text(json.dumps({"train_batch_size": 8}))
    (tmp / "schedule.json").write_text(json.dumps([{"iteration": 0, "weights": {corpus: 1}}]))
    return {
        "corpus": corpus,
        "other": other,
        "vocab2": str(tmp / "vocab2.json"),
        "merges2": str(tmp / "merges2.txt"),
        "hf_a": str(tok / "a.json"),
        "hf_b": str(tok / "b.json"),
        "args": str(tmp / "args.txt"),
        "splits": str(tmp / "splits.json"),
        "ds": str(tmp / "ds.json"),
        "schedule": str(tmp / "schedule.json"),
        "dir": str(tmp / "out"),
    }


def base(f) -> list[str]:
    """A tiny valid command line without --train-iters and --data-path."""
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-3", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100",
    ]  # fmt: skip


# the torch backend's pipeline over 2 ranks, 2 layers per stage
TORCH_PP2 = ["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"]
FULL_UNIFORM_1 = ["--recompute-granularity", "full", "--recompute-method", "uniform"] + [
    "--recompute-num-layers",
    "1",
]


def default_context(f) -> list[str]:
    """What the tiny command line gets unless an entry says otherwise."""
    return ITERS + ["--data-path", f["corpus"], "--split", "90,10,0"]


def changes(f) -> dict:
    """flag -> (argv extra without the flag, argv extra with it, launcher env) where the flag's
    effect shows; a plain list means (ITERS + data, the same + the list, one process)."""
    d = default_context(f)
    gpt2 = d + [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        VOCAB,
        "--merge-file",
        MERGES,
    ]
    hf = d + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f["hf_a"]]
    tiktoken = d + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", CL100K]
    samples = ["--train-samples", "32"] + d[2:]
    sets = ITERS + ["--train-data-path", f["corpus"], "--valid-data-path", f["corpus"], f["other"]]
    launched = {**TWO_RANKS, "LOCAL_WORLD_SIZE": "2"}
    moe = d + ["--num-experts", "4"]
    sigmoid = moe + ["--moe-router-score-function", "sigmoid"]
    capacity = moe + ["--moe-expert-capacity-factor", "1.5"]
    groups = moe + ["--moe-router-num-groups", "2"]
    no_bias = moe + ["--disable-bias-linear"]
    moe_tp2 = no_bias + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    none = ["--load", f["dir"] + "-none", "--save", f["dir"] + "-none", "--save-interval", "2"]
    return {
        # model
        "--num-layers": ["4"], "--hidden-size": ["64"], "--ffn-hidden-size": ["64"],
        "--num-attention-heads": ["8"], "--kv-channels": ["16"], "--group-query-attention": [],
        "--num-query-groups": (d + ["--group-query-attention"], d + ["--group-query-attention", "--num-query-groups", "2"], None),
        "--num-key-value-heads": ["2"], "--max-position-embeddings": ["32"],
        "--position-embedding-type": ["rope"], "--use-rotary-position-embeddings": [],
        "--rotary-base": ["500000"], "--normalization": ["RMSNorm"], "--norm-epsilon": ["1e-6"],
        "--qk-layernorm": [],
        "--swiglu": [], "--untie-embeddings-and-output-weights": [], "--disable-bias-linear": [],
        "--attention-dropout": ["0"], "--hidden-dropout": ["0"], "--init-method-std": ["0.01"],
        "--make-vocab-size-divisible-by": ["64"], "--recompute-activations": [],
        "--checkpoint-activations": [], "--recompute-granularity": ["selective"],
        "--recompute-method": (d + FULL_UNIFORM_1, d + FULL_UNIFORM_1 + ["--recompute-method", "block"], None),
        "--recompute-num-layers": (d + FULL_UNIFORM_1, d + FULL_UNIFORM_1 + ["--recompute-num-layers", "2"], None),
        "--sequence-parallel": (d + ["--tensor-model-parallel-size", "2"], d + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], TWO_RANKS),
        "--openai-gelu": [],
        "--use-rope-scaling": (d + ["--position-embedding-type", "rope"], d + ["--position-embedding-type", "rope", "--use-rope-scaling"], None),
        "--rope-scaling-factor": ["16"], "--rope-scaling-low-freq-factor": ["2"],
        "--rope-scaling-high-freq-factor": ["8"], "--rope-scaling-original-max-position-embeddings": ["4096"],
        "--rotary-position-embeddings-theta": ["500000"],
        "--activations-checkpoint-method": (d + ["--checkpoint-activations"], d + ["--checkpoint-activations", "--activations-checkpoint-method", "block"], None),
        # parallelism
        "--tensor-model-parallel-size": (d, d + ["--tensor-model-parallel-size", "2"], TWO_RANKS),
        "--pipeline-model-parallel-size": (d, d + ["--pipeline-model-parallel-size", "2"], TWO_RANKS),
        "--num-layers-per-virtual-pipeline-stage": (d + TORCH_PP2, d + TORCH_PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], TWO_RANKS),
        "--num-virtual-stages-per-pipeline-rank": (d + TORCH_PP2, d + TORCH_PP2 + ["--num-virtual-stages-per-pipeline-rank", "2"], TWO_RANKS),
        "--pipeline-schedule": (d + TORCH_PP2, d + TORCH_PP2 + ["--pipeline-schedule", "interleaved-zero-bubble"], TWO_RANKS),
        "--zero-stage": ["1"], "--cpu-offload": (d + ["--zero-stage", "1"], d + ["--zero-stage", "1", "--cpu-offload"], None),
        "--offload-optimizer": (d + ["--zero-stage", "1"], d + ["--zero-stage", "1", "--offload-optimizer", "cpu"], None),
        "--offload-param": (d + ["--zero-stage", "3"], d + ["--zero-stage", "3", "--offload-param", "cpu"], None),
        "--offload-nvme-path": (d + ["--zero-stage", "3", "--offload-param", "cpu"], d + ["--zero-stage", "3", "--offload-param", "nvme", "--offload-nvme-path", os.path.dirname(f["ds"])], None),
        "--distributed-backend": ["gloo"], "--distributed-timeout-minutes": ["3"],
        "--deepspeed_config": [f["ds"]], "--local_rank": (d, d + ["--local_rank", "1"], launched),
        "--overlap-grad-reduce": ["--zero-stage", "1"], "--use-torch-fsdp2": [],
        "--async-save": (d + ["--use-torch-fsdp2"], d + ["--use-torch-fsdp2", "--async-save"], None),
        # mixture of experts
        "--num-experts": ["4"],
        "--expert-tensor-parallel-size": (moe_tp2, moe_tp2 + ["--expert-tensor-parallel-size", "1"], TWO_RANKS),
        "--expert-model-parallel-size": (moe, moe + ["--expert-model-parallel-size", "2"], TWO_RANKS),
        "--moe-layer-freq": (moe, moe + ["--moe-layer-freq", "2"], None),
        "--moe-ffn-hidden-size": (moe, moe + ["--moe-ffn-hidden-size", "16"], None),
        "--moe-shared-expert-intermediate-size": (no_bias, no_bias + ["--moe-shared-expert-intermediate-size", "16"], None),
        "--moe-router-topk": (moe, moe + ["--moe-router-topk", "3"], None),
        "--moe-router-score-function": (moe, sigmoid, None),
        "--moe-router-pre-softmax": (moe, moe + ["--moe-router-pre-softmax"], None),
        "--moe-router-topk-scaling-factor": (moe, moe + ["--moe-router-topk-scaling-factor", "2"], None),
        "--moe-router-num-groups": (moe, groups, None),
        "--moe-router-group-topk": (groups, groups + ["--moe-router-group-topk", "1"], None),
        "--moe-router-load-balancing-type": (moe, moe + ["--moe-router-load-balancing-type", "seq_aux_loss"], None),
        "--moe-aux-loss-coeff": (moe, moe + ["--moe-aux-loss-coeff", "0.01"], None),
        "--moe-z-loss-coeff": (moe, moe + ["--moe-z-loss-coeff", "0.001"], None),
        "--moe-router-enable-expert-bias": (sigmoid, sigmoid + ["--moe-router-enable-expert-bias"], None),
        "--moe-router-bias-update-rate": (moe, moe + ["--moe-router-bias-update-rate", "0.01"], None),
        "--moe-router-dtype": (moe, moe + ["--moe-router-dtype", "fp64"], None),
        "--moe-expert-capacity-factor": (moe, capacity, None),
        "--moe-token-drop-policy": (capacity, capacity + ["--moe-token-drop-policy", "position"], None),
        "--moe-pad-expert-input-to-capacity": (capacity, capacity + ["--moe-pad-expert-input-to-capacity"], None),
        "--moe-token-dispatcher-type": (moe, moe + ["--moe-token-dispatcher-type", "alltoall"], None),
        "--moe-grouped-gemm": (moe, moe + ["--moe-grouped-gemm"], None),
        # optimizer and schedule
        "--lr": ["2e-3"], "--min-lr": ["1e-5"], "--lr-decay-style": ["cosine"],
        "--lr-decay-iters": ["2"], "--lr-decay-samples": (samples, samples + ["--lr-decay-samples", "16"], None),
        "--lr-warmup-iters": ["1"], "--lr-warmup-samples": (samples, samples + ["--lr-warmup-samples", "8"], None),
        "--lr-warmup-fraction": ["0.5"], "--lr-warmup-init": ["1e-4"],
        "--lr-wsd-decay-style": (d + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"], d + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--lr-wsd-decay-style", "linear"], None),
        "--lr-wsd-decay-iters": (d, d + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"], None),
        "--lr-wsd-decay-samples": (samples, samples + ["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "16"], None),
        "--rampup-batch-size": (samples, samples + ["--rampup-batch-size", "4", "4", "16"], None),
        "--step-batch-size-schedule": (samples, samples + ["--step-batch-size-schedule", "0:4 128:8"], None),
        "--lr-decay-tokens": ["256"], "--lr-warmup-tokens": ["64"], "--train-tokens": ["64"],
        "--weight-decay": ["0.1"], "--clip-grad": ["0.5"], "--adam-beta1": ["0.8"],
        "--adam-beta2": ["0.95"], "--adam-eps": ["1e-6"], "--bf16": [], "--fp16": [],
        "--loss-scale": ["8"], "--initial-loss-scale": ["1024"], "--min-loss-scale": ["2"],
        "--loss-scale-window": ["500"], "--hysteresis": ["3"],
        "--exit-interval": ["2"], "--exit-duration-in-mins": ["5"],
        "--exit-signal-handler": [], "--exit-signal": ["SIGUSR1"], "--iterations-to-skip": ["2", "4-5"],
        "--no-check-for-nan-in-loss-and-grad": [],
        "--manual-gc": [], "--manual-gc-interval": ["10"], "--no-manual-gc-eval": [],
        "--check-for-spiky-loss": [], "--spiky-loss-policy": (d + ["--check-for-spiky-loss"], d + ["--check-for-spiky-loss", "--spiky-loss-policy", "skip"], None), "--spiky-loss-window": ["16"],
        "--spiky-loss-factor": ["3"], "--spiky-loss-min-window": ["4"],
        # checkpointing
        "--save": (d + ["--save-interval", "2"], d + ["--save-interval", "2", "--save", f["dir"]], None),
        "--save-interval": ["2"], "--load": [f["dir"]], "--no-save-rng": [], "--no-save-full-state": [], "--no-load-optim": [],
        "--save-total-limit": (d + ["--save-interval", "2", "--save", f["dir"]], d + ["--save-interval", "2", "--save", f["dir"], "--save-total-limit", "2"], None),
        "--no-load-rng": [], "--finetune": (d + ["--load", f["dir"]], d + ["--load", f["dir"], "--finetune"], None),
        "--use-checkpoint-args": (d + none, d + none + ["--use-checkpoint-args"], None),
        "--override-opt_param-scheduler": [], "--use-checkpoint-opt_param-scheduler": [],
        # logging
        "--log-interval": ["5"], "--tensorboard-dir": [f["dir"]], "--tensorboard-log-interval": ["5"],
        "--wandb-project": ["p"], "--wandb-exp-name": ["e"], "--peak-tflops": ["100"],
        "--wandb-save-dir": [f["dir"]],
        "--metrics-file": [f["dir"] + ".jsonl"], "--use-distributed-optimizer": [],
        "--logging-level": ["10"],
        # sample counts
        "--seq-length": ["32"], "--seed": ["5"], "--train-iters": ["5"],
        "--train-samples": (d, ["--train-samples", "40"] + d[2:], None),
        "--global-batch-size": ["16"], "--micro-batch-size": ["4"],
        "--eval-interval": ["5"], "--eval-iters": ["5"],
        # data
        "--data-path": [f["other"]], "--mock-data": (d, ITERS + ["--mock-data"], None),
        "--data-args-path": (d, ITERS + ["--data-args-path", f["args"], "--split", "90,10,0"], None),
        "--train-data-path": (d, ITERS + ["--train-data-path", f["other"]], None),
        "--valid-data-path": (d, ITERS + ["--train-data-path", f["corpus"], "--valid-data-path", f["other"]], None),
        "--test-data-path": (d, ITERS + ["--train-data-path", f["corpus"], "--test-data-path", f["other"]], None),
        "--per-split-data-args-path": (d, ITERS + ["--per-split-data-args-path", f["splits"]], None),
        "--multiple-validation-sets": (sets, sets + ["--multiple-validation-sets"], None),
        "--validation-set-names": (sets + ["--multiple-validation-sets"], sets + ["--multiple-validation-sets", "--validation-set-names", "a", "b"], None),
        "--split": ["80,10,10"], "--data-cache-path": [f["dir"]],
        "--blend-weights-unit": ["tokens"], "--allow-tokenizer-mismatch": [],
        "--data-schedule": [f["schedule"]],
        "--mid-level-dataset-surplus": ["0.01"], "--num-dataset-builder-threads": ["2"],
        "--eod-mask-loss": [], "--reset-position-ids": [], "--reset-attention-mask": [],
        "--no-create-attention-mask-in-dataloader": [], "--allow-ambiguous-pad-tokens": [],
        "--num-workers": ["0"], "--dataloader-type": ["cyclic"], "--no-data-sharding": [],
        # tokenizer
        "--tokenizer-type": (d, gpt2, None),
        "--vocab-file": (gpt2, gpt2 + ["--vocab-file", f["vocab2"]], None),
        "--merge-file": (gpt2, gpt2 + ["--merge-file", f["merges2"]], None),
        "--tokenizer-model": (hf, hf + ["--tokenizer-model", f["hf_b"]], None),
        "--vocab-size": ["200"],
        "--tokenizer-engine": (gpt2, gpt2 + ["--tokenizer-engine", "hf"], None),
        "--tokenizer-hf-no-include-special-tokens": (hf, hf + ["--tokenizer-hf-no-include-special-tokens"], None),
        "--tiktoken-pattern": (tiktoken, tiktoken + ["--tiktoken-pattern", "v2"], None),
    }  # fmt: skip


# A value for the no-op flags that take one (a non-default one where there is a choice).
NOOP_VALUES = {
    "--data-impl": ["mmap"],
    "--attention-backend": ["flash"],
    "--optimizer": ["adam"],
    "--rotary-percent": ["1.0"],
    "--tensorboard-queue-size": ["1"],
    # launch-script flags accepted with the value that describes this project
    "--context-parallel-size": ["1"],
    "--ds-sequence-parallel-size": ["1"],
    "--DDP-impl": ["local"],
    "--ckpt-format": ["torch"],
    "--dist-ckpt-strictness": ["log_all"],
    "--recompute-modules": ["core_attn"],
    "--rope-type": ["rope"],
    "--transformer-impl": ["transformer_engine"],
    "--empty-unused-memory-level": ["1"],
    "--per-dataset-sequences-path": ["sequences.json"],
    "--timing-log-level": ["2"],
    "--profile-step-start": ["4"],
    "--profile-step-end": ["6"],
    "--profile-ranks": ["0"],
    "--cuda-graph-impl": ["local"],
}
# The context a no-op needs to be accepted at all (compared with the same context without it).
NOOP_CONTEXT = {"--no-position-embedding": ["--position-embedding-type", "rope"]}


def _aliases(flag: str) -> set[str]:
    return set(build_parser()._option_string_actions[flag].option_strings)


def _config(f, extra, env=None):
    """The parsed run, without the recorded command line (which differs by construction)."""
    argv = base(f)
    if "--step-batch-size-schedule" in extra:  # it replaces --global-batch-size (both: refused)
        del argv[argv.index("--global-batch-size") : argv.index("--global-batch-size") + 2]
    cfg = parse_args(argv + extra, env=env or ONE_RANK)
    return dataclasses.replace(cfg, argv=())


def _case(table: dict, flag: str, f) -> tuple[list, list, dict | None]:
    spec = next(table[alias] for alias in _aliases(flag) if alias in table)
    if isinstance(spec, tuple):
        without, with_, env = spec
    else:
        without, env = default_context(f), None
        with_ = without + [flag, *spec]
    primary = next(alias for alias in _aliases(flag) if alias in table)
    return without, [flag if a == primary else a for a in with_], env


def test_every_flag_is_classified(help_flags, files):
    table = changes(files)
    effective = {flag for flag, text in help_flags.items() if not NOOP_HELP.match(text)}
    covered = {flag for flag in effective if _aliases(flag) & set(table)}
    assert covered == effective, f"flags without a CHANGES entry: {sorted(effective - covered)}"
    stale = {flag for flag in table if flag not in help_flags}
    assert not stale, f"CHANGES names flags --help does not list: {sorted(stale)}"
    noop_with_entry = {f for f in help_flags if NOOP_HELP.match(help_flags[f]) and f in table}
    assert not noop_with_entry, f"documented as no-ops but listed in CHANGES: {noop_with_entry}"


def test_every_effective_flag_changes_the_run(help_flags, files):
    table = changes(files)
    unchanged = []
    for flag, text in help_flags.items():
        if NOOP_HELP.match(text):
            continue
        without, with_, env = _case(table, flag, files)
        reference = _config(files, without, env)
        if flag == "--fp16" and not torch.cuda.is_available():
            with pytest.raises(UserError, match="--fp16 needs a GPU"):
                _config(files, with_, env)
            continue
        if _config(files, with_, env) == reference:
            unchanged.append(flag)
    assert not unchanged, (
        f"accepted but without effect (say no-op in --help, or wire up): {unchanged}"
    )


def test_documented_noops_change_nothing(help_flags, files):
    noops = [flag for flag, text in help_flags.items() if NOOP_HELP.match(text)]
    assert len(noops) >= 20  # the script-compatibility group, Megatron-DeepSpeed's extras
    for flag in noops:
        value = NOOP_VALUES.get(flag, [])
        context = default_context(files) + NOOP_CONTEXT.get(flag, [])
        got = _config(files, context + [flag, *value])
        assert got == _config(files, context), (
            f"{flag} is documented as a no-op but changes the run"
        )


@pytest.mark.parametrize(
    "extra,env,message",
    [
        (["--rotary-percent", "0.5"], None, "--rotary-percent 0.5: only 1.0 is implemented"),
        (["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"], TWO_RANKS,
         "--no-pipeline-parallel contradicts --pipeline-model-parallel-size 2"),
        (["--optimizer", "sgd"], None, "argument --optimizer: invalid choice: 'sgd'"),
        (["--dist-ckpt-strictness", "raise_al"], None,
         "argument --dist-ckpt-strictness: invalid choice: 'raise_al'"),
        (["--lr-warmup-tokens", "64", "--lr-warmup-iters", "1"], None,
         "--lr-warmup-tokens and --lr-warmup-iters/-samples/-fraction are exclusive"),
    ],
)  # fmt: skip
def test_accepted_flags_refuse_what_they_cannot_do(files, extra, env, message):
    with pytest.raises(UserError, match=re.escape(message)):
        argv = base(files) + default_context(files) + extra
        parse_args(argv, env=env or ONE_RANK)


def test_token_flags_are_megatron_deepspeeds_arithmetic(files):
    """--lr-*-tokens are samples x --seq-length (16); --train-tokens stops the loop."""
    cfg = _config(files, default_context(files) + ["--lr-decay-tokens", "264",
                                  "--lr-warmup-tokens", "40", "--train-tokens", "100"])  # fmt: skip
    assert cfg.schedule.decay_samples == 264 / 16 and cfg.schedule.warmup_samples == 40 / 16
    assert cfg.training.train_tokens == 100 and cfg.training.train_iters == 4
