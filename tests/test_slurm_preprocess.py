"""`examples/slurm_preprocess_array.sbatch` and its merge job, as its header says to submit them,
on the real two-node Slurm cluster: three array tasks (one input shard each) spread over both
nodes, then `merge_datasets.py` in a job that waits for them (`--dependency=afterok`). The merged
.bin/.idx are byte for byte what one `preprocess_data.py` run over the three shards writes.

Skipped where `slurm-wlm` and `munge` are not installed (`.ci/run` installs them).
"""

from __future__ import annotations

import json
import random
import re
import subprocess

import pytest
import slurm_cluster
from cluster_fixtures import job_info, slurm, wait_ended
from training_fixtures import BIN, PYTHON, REPO, run
from training_fixtures import test_env as clean_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SHARDS = 3
TOKENIZER = "--tokenizer-type NullTokenizer --vocab-size 100"


def _shards(raw) -> list[str]:
    """SHARDS JSONL files of 20 NullTokenizer texts (space-separated ids) each."""
    raw.mkdir()
    paths = []
    for i in range(SHARDS):
        rng = random.Random(i)
        texts = [
            " ".join(map(str, rng.choices(range(100), k=rng.randrange(3, 40)))) for _ in range(20)
        ]
        paths.append(raw / f"part-{i}.jsonl")
        paths[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return [str(p) for p in paths]


def _sbatch(root, *args: str) -> str:
    """sbatch from the repository, the tests' Python first on PATH; the job id."""
    env = slurm_cluster.env(root, clean_env(PATH=f"{BIN}:/usr/bin:/bin:/usr/sbin:/sbin"))
    result = subprocess.run(
        ["sbatch", "--parsable", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def _one_run(inputs: list[str], prefix) -> None:
    """One preprocess_data.py run over every shard, here."""
    cmd = [PYTHON, str(REPO / "tools" / "preprocess_data.py"), "--input", *inputs]
    cmd += ["--output-prefix", str(prefix), *TOKENIZER.split(), "--append-eod", "--workers", "1"]
    result = run(cmd, timeout=120)
    assert result.returncode == 0, result.stdout


@pytest.mark.timeout(300)
def test_array_tasks_and_the_merge_job_write_one_runs_bytes(cluster, tmp_path):
    inputs = _shards(tmp_path / "raw")
    shard_dir, merged = tmp_path / "shards", tmp_path / "corpus_text_document"
    exported = f"INPUT_GLOB={tmp_path / 'raw' / '*.jsonl'},SHARD_DIR={shard_dir}"
    exported += f",TOKENIZER_FLAGS={TOKENIZER}"
    array = _sbatch(
        cluster,
        *(f"--array=0-{SHARDS - 1}", "--cpus-per-task", "2", "--output", f"{tmp_path}/%A_%a.out"),
        *(f"--export=ALL,{exported}", "examples/slurm_preprocess_array.sbatch"),
    )
    merge = f"python tools/merge_datasets.py --input {shard_dir} --output-prefix {merged}"
    merge_job = _sbatch(
        cluster,
        f"--dependency=afterok:{array}",
        "--output",
        f"{tmp_path}/merge.out",
        "--wrap",
        merge,
    )
    info = wait_ended(cluster, merge_job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info
    records = slurm(cluster, "scontrol", "show", "job", "-o", array)
    tasks = re.findall(r"ArrayTaskId=(\d+) .*?\sNodeList=(\S+)", records)
    assert sorted(t for t, _ in tasks) == ["0", "1", "2"], records
    assert {node for _, node in tasks} == {"n1", "n2"}, tasks  # the array used both nodes
    assert job_info(cluster, array)["JobState"] == "COMPLETED"

    _one_run(inputs, tmp_path / "one")
    for ext in ("bin", "idx"):
        got = (tmp_path / f"corpus_text_document.{ext}").read_bytes()
        assert got == (tmp_path / f"one_text_document.{ext}").read_bytes(), ext
