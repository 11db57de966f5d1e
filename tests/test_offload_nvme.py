"""ZeRO-Infinity on the CPU accelerator: ZeRO-3 with the parameters and the optimizer state
offloaded to an NVMe folder (`--offload-param nvme --offload-optimizer nvme --offload-nvme-path`)
logs the losses and grad norms of the run without offload, and DeepSpeed's swap files appear in
the folder.

DeepSpeed swaps only tensors of at least 1 MiB (its aio block size; smaller ones stay in memory),
so the model here is 512 wide: its matrices' DP-2 partitions are 1.5-4 MiB. NVMe offload needs
DeepSpeed's async_io op: libaio (`.ci/run` installs libaio-dev) and a JIT build, done once here
(about 10 minutes on 2 loaded cores; cached in ~/.cache/torch_extensions afterwards).
"""

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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ITERS = 3
RTOL = 1e-6


def _async_io_builder():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("AsyncIOBuilder")


@pytest.fixture(scope="module")
def async_io():
    """DeepSpeed's async_io op, built (or loaded from the cache) before any run needs it."""
    builder = _async_io_builder()
    if builder is None or not builder.is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io op cannot build here (install libaio-dev)")
    return builder.load(verbose=False)


@pytest.fixture(scope="module")
def runs(async_io, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nvme")
    corpus = make_corpus(tmp / "corpus")
    swap = tmp / "swap"
    swap.mkdir()
    argvs = []
    for name, extra in (
        ("plain", []),
        ("nvme", ["--offload-param", "nvme", "--offload-optimizer", "nvme"]),
    ):
        flags = model_flags("gpt2") + ["--hidden-size", "512"]  # overrides model_flags' 32
        flags += train_flags(corpus, iters=ITERS) + layout_flags(1, 1, 3)
        flags += ["--metrics-file", str(tmp / f"{name}.jsonl"), *extra]
        argvs.append(flags + (["--offload-nvme-path", str(swap)] if extra else []))
    result = run(multirun_cmd(2, argvs, tmp / "runs.json"), timeout=900)
    assert result.returncode == 0, result.stdout[-8000:]
    return tmp, swap, result.stdout


def test_nvme_offload_equals_no_offload(runs):
    tmp, _, _ = runs
    plain, nvme = read_metrics(tmp / "plain.jsonl"), read_metrics(tmp / "nvme.jsonl")
    assert sorted(plain) == sorted(nvme) == list(range(1, ITERS + 1))
    for it in plain:
        for key in ("lm-loss", "grad-norm"):
            assert abs(nvme[it][key] - plain[it][key]) <= RTOL * abs(plain[it][key]), (it, key)


def test_swap_files_are_written_per_rank(runs):
    _, swap, output = runs
    root = swap / "zero_stage_3"
    for kind in ("float32params", "optimizer"):
        for rank in (0, 1):
            files = list((root / kind / f"rank{rank}").glob("*.tensor.swp"))
            assert files and all(f.stat().st_size >= 2**20 for f in files), (kind, rank, files)
    assert " offload          |  optimizer state: nvme (AdamW), parameters: nvme\n" in output
