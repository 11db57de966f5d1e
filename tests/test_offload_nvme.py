"""ZeRO-Infinity on the CPU accelerator: ZeRO-3 with the parameters and the optimizer state
offloaded to an NVMe folder (`--offload-param nvme --offload-optimizer nvme --offload-nvme-path`)
logs the losses and grad norms of the run without offload, and DeepSpeed's swap files appear in
the folder; a checkpoint of a run with NVMe parameters resumes with or without offload.

DeepSpeed swaps only tensors of at least 1 MiB (its aio block size; smaller ones stay in memory),
so the model here is 512 wide: its matrices' DP-2 partitions are 1.5-4 MiB. NVMe offload needs
DeepSpeed's async_io op: libaio (`.ci/run` installs libaio-dev) and a JIT build (minutes of CPU;
cached in ~/.cache/torch_extensions afterwards), which tests/op_builds.py starts in the background
at the beginning of the session; the fixture below waits for it on torch's build lock.
"""

import op_builds
import pytest
from training_fixtures import (
    layout_flags,
    make_corpus,
    model_flags,
    multirun_cmd,
    read_metrics,
    run,
    train_flags,
)

pytestmark = [pytest.mark.slow, pytest.mark.needs_async_io, pytest.mark.timeout(2400)]

ITERS, STOP_AT = 4, 2
RTOL = 1e-6


@pytest.fixture(scope="module")
def async_io():
    """DeepSpeed's async_io op, built (or loaded from the cache) before any run needs it."""
    if not op_builds.async_io_buildable():
        pytest.skip(op_builds.ASYNC_IO_MISSING)
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("AsyncIOBuilder").load(verbose=False)


def _flags(corpus, tmp, name, *extra):
    flags = model_flags("gpt2") + ["--hidden-size", "512"]  # overrides model_flags' 32
    flags += train_flags(corpus, iters=ITERS) + layout_flags(1, 1, 3)
    return flags + ["--metrics-file", str(tmp / f"{name}.jsonl"), *extra]


@pytest.fixture(scope="module")
def runs(async_io, tmp_path_factory):
    """Launch 1: the plain run, the NVMe run, and a run with NVMe parameters (CPU optimizer)
    stopped at STOP_AT with a checkpoint. Launch 2: that checkpoint resumed with NVMe
    parameters and without offload."""
    tmp = tmp_path_factory.mktemp("nvme")
    corpus = make_corpus(tmp / "corpus")
    for folder in ("swap", "swap_p", "swap_r"):
        (tmp / folder).mkdir()

    def nvme_params(folder):
        return [
            "--offload-param",
            "nvme",
            "--cpu-offload",
            "--offload-nvme-path",
            str(tmp / folder),
        ]

    both = ["--offload-param", "nvme", "--offload-optimizer", "nvme"]
    stop = ["--save", str(tmp / "ckpt"), "--save-interval", "100", "--exit-interval", str(STOP_AT)]
    first = [
        _flags(corpus, tmp, "plain"),
        _flags(corpus, tmp, "nvme", *both, "--offload-nvme-path", str(tmp / "swap")),
        _flags(corpus, tmp, "params_first", *nvme_params("swap_p"), *stop),
    ]
    load = ["--load", str(tmp / "ckpt")]
    second = [
        _flags(corpus, tmp, "params_resumed_nvme", *nvme_params("swap_r"), *load),
        _flags(corpus, tmp, "params_resumed_plain", *load),
    ]
    outputs = []
    for argvs, label in ((first, "first"), (second, "second")):
        result = run(multirun_cmd(2, argvs, tmp / f"{label}.json"), timeout=900)
        assert result.returncode == 0, result.stdout[-8000:]
        outputs.append(result.stdout)
    return tmp, tmp / "swap", outputs[0]


def _assert_close(got, ref):
    for it in got:
        for key in ("lm-loss", "grad-norm"):
            assert abs(got[it][key] - ref[it][key]) <= RTOL * abs(ref[it][key]), (it, key)


def test_nvme_offload_equals_no_offload(runs):
    tmp, _, _ = runs
    plain, nvme = read_metrics(tmp / "plain.jsonl"), read_metrics(tmp / "nvme.jsonl")
    assert sorted(plain) == sorted(nvme) == list(range(1, ITERS + 1))
    _assert_close(nvme, plain)
    _assert_close(read_metrics(tmp / "params_first.jsonl"), plain)


@pytest.mark.parametrize("resumed", ["nvme", "plain"])
def test_nvme_parameter_checkpoint_resumes(runs, resumed):
    """NVMe parameters (CPU optimizer) save and resume, with or without offload. (NVMe optimizer
    state does not: --save/--load with it is refused, tests/test_offload_args.py.)"""
    tmp, _, _ = runs
    got = read_metrics(tmp / f"params_resumed_{resumed}.jsonl")
    assert sorted(got) == list(range(STOP_AT + 1, ITERS + 1))
    _assert_close(got, read_metrics(tmp / "plain.jsonl"))


def test_swap_files_are_written_per_rank(runs):
    _, swap, output = runs
    root = swap / "zero_stage_3"
    for kind in ("float32params", "optimizer"):
        for rank in (0, 1):
            files = list((root / kind / f"rank{rank}").glob("*.tensor.swp"))
            assert files and all(f.stat().st_size >= 2**20 for f in files), (kind, rank, files)
    assert " offload          |  optimizer state: nvme (AdamW), parameters: nvme\n" in output
