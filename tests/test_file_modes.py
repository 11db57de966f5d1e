"""Every file and folder the tools write gets the mode a plain open()/mkdir gives under the
umask (no 0600/0700 left by tempfile's mkstemp/mkdtemp): preprocess_data.py, a 1-rank
pretrain_gpt.py run with --save, convert_to_hf.py and build_data_cache.py, run as real processes
under umask 022 and 077."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
from tokenizer_fixtures import MERGES, VOCAB
from training_fixtures import (
    PYTHON,
    REPO,
    layout_flags,
    make_corpus,
    model_flags,
    torchrun_cmd,
    train_flags,
)
from training_fixtures import (
    test_env as training_env,
)

GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES]


def run_under(umask: int, cmd: list[str], timeout: float = 300) -> str:
    """Run `cmd` with `umask` in a new session; assert it succeeds; returns its output."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=training_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: os.umask(umask),
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out: {' '.join(cmd)}\n{out[-6000:]}") from None
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{out[-6000:]}"
    return out


def plain_modes(umask: int, where: Path) -> tuple[int, int]:
    """(file mode, folder mode) that a plain open()/os.mkdir gives in a process with `umask`."""
    script = "import os, sys; open(sys.argv[1] + '/f', 'w').close(); os.mkdir(sys.argv[1] + '/d')"
    where.mkdir()
    run_under(umask, [PYTHON, "-c", script, str(where)])
    modes = (stat.S_IMODE(os.stat(where / "f").st_mode), stat.S_IMODE(os.stat(where / "d").st_mode))
    return modes


def wrong_modes(root: Path, file_mode: int, folder_mode: int) -> list[str]:
    """Every file/folder under `root` (root itself excluded) whose mode is not the plain one."""
    wrong = []
    for entry in sorted(root.rglob("*")):
        st = os.lstat(entry)
        if stat.S_ISLNK(st.st_mode):
            continue
        want = folder_mode if stat.S_ISDIR(st.st_mode) else file_mode
        if stat.S_IMODE(st.st_mode) != want:
            wrong.append(
                f"{entry.relative_to(root)}: {oct(stat.S_IMODE(st.st_mode))} != {oct(want)}"
            )
    return wrong


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_every_written_file_and_folder_follows_the_umask(tmp_path, umask):
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    docs = inputs / "docs.jsonl"
    docs.write_text(
        "".join(json.dumps({"text": f"document {i} of the corpus"}) + "\n" for i in range(40))
    )
    corpus = make_corpus(inputs / "corpus")

    tool = lambda name: [PYTHON, str(REPO / "tools" / name)]  # noqa: E731
    run_under(
        umask,
        tool("preprocess_data.py")
        + [
            "--input",
            str(docs),
            "--output-prefix",
            str(out / "pre"),
            "--workers",
            "1",
            "--append-eod",
        ]
        + GPT2,
    )
    training = model_flags("gpt2") + train_flags(corpus, iters=2) + layout_flags(1, 1, 0)
    training += ["--data-cache-path", str(out / "train_cache")]
    run_under(
        umask,
        torchrun_cmd(1, training + ["--save", str(out / "ckpt"), "--save-interval", "2"]),
        timeout=600,
    )
    run_under(
        umask,
        tool("convert_to_hf.py") + ["--load", str(out / "ckpt"), "--output-dir", str(out / "hf")],
    )
    cache_flags = [f if f != str(out / "train_cache") else str(out / "cache") for f in training]
    run_under(umask, tool("build_data_cache.py") + cache_flags)

    written = {str(p.relative_to(out)) for p in out.rglob("*")}
    expected = {
        "pre_text_document.bin",
        "pre_text_document.idx",
        "pre_text_document.json",
        "ckpt/latest",
        "ckpt/global_step2/pretrain_meta.json",
        "ckpt/global_step2",
        "ckpt/global_step2/rng_state_0.pt",
        "ckpt/global_step2/full_state_tp00_pp00.pt",
        "ckpt/global_step2/mp_rank_00_model_states.pt",
        "hf/model.safetensors",
        "hf/config.json",
    }
    assert expected <= written, sorted(written)
    for cache in ("cache/", "train_cache/"):  # build_data_cache.py's, the training run's
        assert any(p.startswith(cache) and p.endswith("sample_index.npy") for p in written)
    file_mode, folder_mode = plain_modes(umask, tmp_path / "plain")
    assert (file_mode, folder_mode) == (0o666 & ~umask, 0o777 & ~umask)
    assert wrong_modes(out, file_mode, folder_mode) == []
