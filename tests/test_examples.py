"""The launch recipes in examples/ use flags that pretrain_gpt.py accepts, at the layouts they launch.

The GPU recipes cannot run here (no GPU); this keeps their shared flag file from drifting away from
the argument parser. The CPU launch line itself is what `make train` / `make demo` run."""

import subprocess

import pytest
from training_fixtures import REPO, make_corpus

from pretrain.cli import parse_args

# (world size, TP, PP) of each recipe: single node deepspeed/torchrun, multi-node, Slurm, Kubeflow
LAYOUTS = [(8, 8, 1), (8, 2, 2), (16, 8, 2), (32, 8, 2)]


@pytest.fixture(scope="module")
def example_args(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    prefix = make_corpus(root / "corpus", num_docs=20)
    env = {"DATA_PREFIX": str(prefix), "SAVE_DIR": str(root / "save"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [
            "bash",
            "-c",
            "source examples/model_gpt2_1.3b.sh && "
            'printf "%s\\n" "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"',
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.splitlines()


@pytest.mark.parametrize("world, tp, pp", LAYOUTS)
def test_recipe_flags_parse(example_args, world, tp, pp):
    # the recipes use the GPT-2 BPE files; point them at a NullTokenizer so the test needs no data/
    argv = list(example_args)
    i = argv.index("--tokenizer-type")
    argv[i : i + 6] = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"]
    env = {
        "RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }
    cfg = parse_args(
        argv + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)],
        env=env,
    )
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (
        tp,
        pp,
    )
    assert cfg.parallel.data_parallel_size == world // (tp * pp)
    assert cfg.precision.bf16 and cfg.parallel.zero_stage == 1
    assert cfg.training.exit_signal_handler  # preemption saves (docs/RELIABILITY.md)
    assert cfg.training.global_batch_size == 512
