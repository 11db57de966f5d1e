"""tools/preprocess_data.py on a shared cluster: a run never reads its own outputs, never writes
another run's files, never removes a live run's temporary. Real processes, real files, signals."""

import glob
import json
import os
import socket
import subprocess

import pytest
from test_preprocess import make_records, same_files, write_jsonl
from test_preprocess_reliability import (
    big_corpus,
    finish_paused,
    one_error_line,
    paused_run,
    preprocess_cmd,
    run,
)

from pretrain.data.files.indexed_dataset import IndexedDataset


def test_input_named_like_the_runs_sidecar_is_refused(tmp_path):
    """`--input same_text_document.json --output-prefix same`: the input is the output's sidecar;
    one error line, the input intact, nothing written."""
    src = write_jsonl(tmp_path / "same_text_document.json", make_records(seed=1, n=20))
    before = open(src, "rb").read()
    line = one_error_line(run(preprocess_cmd(src, tmp_path / "same")))
    assert f"--input {src}: is one of this run's outputs" in line
    assert open(src, "rb").read() == before
    assert os.listdir(tmp_path) == ["same_text_document.json"]


def test_folder_input_that_holds_the_outputs_skips_them(tmp_path):
    """Input folder == output folder, run twice (then by a glob): later runs read only the corpus,
    not the first run's sidecar, and write the same bytes and a sidecar."""
    write_jsonl(tmp_path / "c.jsonl", make_records(seed=2, n=30))
    prefix = f"{tmp_path}/out"
    first = run(preprocess_cmd(tmp_path, prefix, "--skip-bad-lines"))
    assert first.returncode == 0, first.stderr
    os.rename(f"{prefix}_text_document.bin", f"{tmp_path}/first.bin")
    os.rename(f"{prefix}_text_document.idx", f"{tmp_path}/first.idx")
    second = run(preprocess_cmd(tmp_path, prefix, "--skip-bad-lines"))
    assert second.returncode == 0, second.stderr
    assert "skipped" not in second.stderr and "Traceback" not in second.stderr
    assert same_files(f"{prefix}_text_document", f"{tmp_path}/first")
    assert os.path.isfile(f"{prefix}_text_document.json")
    by_glob = run(preprocess_cmd(f"{tmp_path}/*.json*", prefix, "--skip-bad-lines"))
    assert by_glob.returncode == 0 and "skipped" not in by_glob.stderr, by_glob.stderr
    assert same_files(f"{prefix}_text_document", f"{tmp_path}/first")


@pytest.mark.timeout(300)
def test_aliased_prefix_and_key_refuses_while_the_first_run_writes(tmp_path):
    """`--output-prefix P_k --json-keys x_text` and `--output-prefix P_k_x --json-keys text` name
    one output: run B refuses while A (stopped) writes it, A's temporary stays, A completes."""
    src = big_corpus(tmp_path / "c.jsonl")
    aliased = write_jsonl(
        tmp_path / "x.jsonl", [{"x_text": json.loads(r)["text"]} for r in open(src)]
    )
    out = tmp_path / "P_k_x_text_document"
    run_a = preprocess_cmd(aliased, tmp_path / "P_k", "--json-keys", "x_text")
    with paused_run(run_a, f"{out}.bin.*.tmp") as first:
        (live,) = glob.glob(f"{out}.bin.*.tmp")
        line = one_error_line(run(preprocess_cmd(src, tmp_path / "P_k_x")))
        assert f"--output-prefix {tmp_path}/P_k_x: another run is writing {out}.bin/.idx" in line
        assert os.path.exists(live)  # A's temporary is untouched
        finish_paused(first)
    assert first.returncode == 0, first.stderr_text
    assert glob.glob(f"{tmp_path}/*.lock") == []  # finished: A removed its lock file
    assert IndexedDataset(str(out)).num_documents == 3000


def test_temporary_of_a_live_owner_is_kept(tmp_path):
    """Beside the output: temporaries named by a live and a dead process of this host and by
    another host; the run removes only the dead one's and says it kept the others."""
    src = write_jsonl(tmp_path / "c.jsonl", make_records(seed=3, n=20))
    prefix = tmp_path / "out"
    host = socket.gethostname()
    alive = subprocess.Popen(["sleep", "120"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        live_tmp = f"{prefix}_text_document.bin.{host}.{alive.pid}.0123abcd.tmp"
        dead_tmp = f"{prefix}_text_document.idx.{host}.{dead.pid}.0123abcd.tmp"
        elsewhere_tmp = f"{prefix}_text_document.bin.{host}-b.{dead.pid}.0123abcd.tmp"
        for path in (live_tmp, dead_tmp, elsewhere_tmp):
            open(path, "wb").write(b"partial")
        proc = run(preprocess_cmd(src, prefix))
        assert proc.returncode == 0, proc.stderr
        assert os.path.exists(live_tmp) and not os.path.exists(dead_tmp)
        assert os.path.exists(elsewhere_tmp)  # another host's processes cannot be seen from here
        assert f"removed {dead_tmp} (left by an interrupted run)" in proc.stderr
        assert f"warning: kept {live_tmp} (its owner may still run)" in proc.stderr
    finally:
        alive.kill()
        alive.wait()


def test_unwritable_prefix_says_it_cannot_be_written(tmp_path):
    """`--output-prefix /proc/out`: not "another run is writing", but that it cannot be written."""
    src = write_jsonl(tmp_path / "c.jsonl", make_records(seed=4, n=5))
    line = one_error_line(run(preprocess_cmd(src, "/proc/out")))
    assert line.startswith("error: --output-prefix /proc/out: cannot be written"), line
    assert "another run" not in line


def test_folder_input_skips_another_runs_sidecar(tmp_path):
    """Two runs with different prefixes on one folder: the second reads the corpus only, not the
    first's `PREFIX.json` fingerprint (before: read as a JSON-lines corpus and refused)."""
    from test_preprocess import preprocess

    corpus = write_jsonl(tmp_path / "c.jsonl", make_records(seed=5, n=30))
    preprocess([tmp_path], tmp_path / "a", workers=1)
    preprocess([tmp_path], tmp_path / "b", workers=1)
    assert same_files(f"{tmp_path}/b_text_document", f"{tmp_path}/a_text_document")
    with open(f"{tmp_path}/b_text_document.json") as f:
        assert [i["path"] for i in json.load(f)["inputs"]] == [str(corpus)]


@pytest.mark.parametrize("where", ["prefix", "bin"])
def test_an_output_prefix_naming_a_folder_is_one_line_before_any_work(tmp_path, where):
    """`--output-prefix dir/` (before: wrote `dir/_text_document.*`) and an output name taken by
    a folder (before: a traceback at the final rename, after all the tokenizing)."""
    from test_preprocess_reliability import GPT2_FLAGS

    from pretrain.data.files.preprocess import main
    from pretrain.errors import UserError

    src = write_jsonl(tmp_path / "c.jsonl", make_records(seed=6, n=5))
    (tmp_path / "out").mkdir()
    prefix, words = f"{tmp_path}/out/", "names a folder, not a file prefix"
    if where == "bin":
        (tmp_path / "out_text_document.bin").mkdir()
        prefix, words = f"{tmp_path}/out", "out_text_document.bin is a folder"
    argv = ["--input", str(src), "--output-prefix", prefix, "--workers", "1", *GPT2_FLAGS]
    with pytest.raises(UserError, match=words) as err:
        main(argv)
    assert "\n" not in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "out"] + (
        ["out_text_document.bin"] if where == "bin" else []
    )
    assert os.listdir(tmp_path / "out") == []
