#!/usr/bin/env python
"""Train a small byte-level BPE tokenizer on a JSONL corpus with Hugging Face `tokenizers`.

    python tools/train_demo_tokenizer.py --input data/shakespeare.jsonl --output-dir data/shakespeare_bpe

Writes OUTPUT_DIR/tokenizer.json and tokenizer_config.json (eos `<|endoftext|>`), usable with
`--tokenizer-type HuggingFaceTokenizer --tokenizer-model OUTPUT_DIR` and by transformers'
AutoTokenizer. `make demo` uses a 4,096-token one: a model small enough for a CPU then spends its
compute on Shakespeare instead of on a 50,257-way softmax. A re-run with the files present is a no-op.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pretrain.atomic import atomic_write_bytes, make_temp_folder  # noqa: E402
from pretrain.errors import UserError, exit_on_user_error  # noqa: E402
from pretrain.outputs import ignore_file_size_signal, refuse_output, reported_writes  # noqa: E402

EOD = "<|endoftext|>"


def texts(path: str, key: str):
    """The `key` field of every JSON line of `path`."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)[key]
                except (json.JSONDecodeError, KeyError) as err:
                    raise UserError(f"{path}:{number}: no JSON {key!r} field ({err})") from None


def train(path: str, key: str, vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with `vocab_size` ids, EOD last added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(path, key), trainer=trainer)
    return tok


def save(tok, out_dir: str) -> None:
    """Write tokenizer.json and tokenizer_config.json into a temporary folder beside `out_dir`,
    then rename it to `out_dir` (or, when `out_dir` holds other files, each file into it,
    tokenizer.json last): a failed run leaves no half-written folder."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = make_temp_folder(parent, f".{os.path.basename(os.path.abspath(out_dir))}.partial.")
    try:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD, "bos_token": EOD}
        files = {
            "tokenizer_config.json": json.dumps(config).encode(),
            "tokenizer.json": tok.to_str().encode("utf-8"),  # last: its presence means done
        }
        for name, data in files.items():
            atomic_write_bytes(os.path.join(tmp, name), data)
        if not os.path.isdir(out_dir) or not os.listdir(out_dir):
            os.replace(tmp, out_dir)
            return
        for name in files:
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", required=True, help="JSONL corpus")
    p.add_argument("--json-key", default="text", help="field holding the text (default: text)")
    p.add_argument("--output-dir", required=True, help="folder for tokenizer.json and its config")
    p.add_argument("--vocab-size", type=int, default=4096, help="ids, EOD included (default 4096)")
    args = p.parse_args(argv)
    ignore_file_size_signal()
    out = os.path.join(args.output_dir, "tokenizer.json")
    if os.path.isfile(out):
        print(f"{out} exists; keeping it")
        return 0
    if not os.path.isfile(args.input):
        raise UserError(f"--input {args.input}: no such file (run `make data` first)")
    from pretrain.checkpoint.outputs import kept_data

    refuse_output("--output-dir", args.output_dir, [("--input", args.input)], protect=kept_data)
    tok = train(args.input, args.json_key, args.vocab_size)
    with reported_writes("--output-dir", args.output_dir):
        save(tok, args.output_dir)
    print(f"wrote {out} ({tok.get_vocab_size()} ids, trained on {args.input})")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main)())
