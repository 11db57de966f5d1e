"""SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer: ids, eod, pad and vocab size
equal `sentencepiece` itself and megatron-core's own tokenizer objects for a model trained here;
preprocessing writes those ids; the training flags take the vocab size from the model."""

import json
import random
import warnings

import numpy as np
import pytest
from tokenizer_fixtures import awkward_texts

from pretrain.data.files.preprocess import PreprocessConfig, run
from pretrain.tokenizer import TokenizerConfig, build_tokenizer

TYPES = ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]


def _train(folder, name, **options):
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["the", "king", "queen", "crown", "sword", "night", "day", "love", "war", "thou"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    prefix = str(folder / name)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=prefix,
        vocab_size=320,
        hard_vocab_limit=False,
        minloglevel=2,
        **options,
    )
    return prefix + ".model"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    return {
        "default": _train(d, "plain", model_type="bpe"),  # unk 0, bos 1, eos 2, no pad
        "with_pad": _train(d, "pad", model_type="unigram", pad_id=3, byte_fallback=True),
    }


def megatron(kind, model):
    warnings.filterwarnings("ignore")
    from test_tokenizer_identity import megatron_tokenizer

    return megatron_tokenizer(tokenizer_type=kind, tokenizer_model=model)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("which", ["default", "with_pad"])
def test_ids_eod_pad_vocab_equal_sentencepiece_and_megatron(models, kind, which):
    import sentencepiece as spm
    from test_tokenizer_identity import main_identity

    model = models[which]
    sp = spm.SentencePieceProcessor(model_file=model)
    theirs = megatron(kind, model)
    ours = build_tokenizer(TokenizerConfig(tokenizer_type=kind, tokenizer_model=model))
    texts = ["the king and the queen", "", "  two  spaces ", *awkward_texts(seed=5, n=20)]
    ids = ours.tokenize_batch(texts)
    assert ids == [sp.encode(t) for t in texts]  # no BOS/EOS added, Llama2Tokenizer included
    assert ids == [theirs.tokenize(t) for t in texts]
    assert ours.eod == sp.eos_id() == theirs.eod
    assert ours.vocab_size == sp.get_piece_size() == theirs.vocab_size
    assert (-1 if ours.pad is None else ours.pad) == sp.pad_id() == theirs.pad
    assert ours.detokenize(ids[0]) == "the king and the queen"
    assert ours.unique_identifiers == main_identity(theirs, "SentencePieceTokenizer")


def test_preprocess_writes_the_model_ids(models, tmp_path):
    import sentencepiece as spm

    warnings.filterwarnings("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    model = models["with_pad"]
    sp = spm.SentencePieceProcessor(model_file=model)
    texts = ["the king", "", "thou love war", *awkward_texts(seed=2, n=6)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    cfg = PreprocessConfig(
        inputs=[str(src)],
        output_prefix=str(tmp_path / "out"),
        tokenizer=TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=model),
        append_eod=True,
        workers=2,
    )
    run(cfg)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    docs = [sp.encode(t) + [sp.eos_id()] for t in texts if sp.encode(t)]
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds[0].dtype == np.uint16


def test_training_flags_take_vocab_and_eod_from_the_model(models, tmp_path):
    from pretrain.cli import parse_args

    model = models["default"]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "the king and the queen " * 20}) + "\n")
    tok = TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model)
    run(PreprocessConfig(inputs=[str(src)], output_prefix=str(tmp_path / "d"), tokenizer=tok))
    argv = (
        "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
        "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 1 --train-iters 1 "
        "--lr 1e-3 --tokenizer-type GPTSentencePieceTokenizer"
    ).split() + ["--tokenizer-model", model, "--data-path", str(tmp_path / "d_text_document")]
    cfg = parse_args(argv)
    assert cfg.model.vocab_size == build_tokenizer(cfg.tokenizer).vocab_size > 20
    assert build_tokenizer(cfg.tokenizer).eod == 2
