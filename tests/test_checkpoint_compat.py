"""`--load` compatibility is decided before any process group exists: a converted (weights-only)
checkpoint needs --finetune, and model shapes are compared as resolved sizes, not raw flag values."""

import dataclasses

import pytest
from training_fixtures import make_corpus, model_flags, train_flags

from pretrain.cli import parse_args
from pretrain.convert.checkpoint_writer import write_checkpoint
from pretrain.errors import UserError
from pretrain.model import GPTModel
from pretrain.training.checkpointing import check_before_launch


def check(cfg):
    """The --load check training runs before any process group exists."""
    check_before_launch(cfg.checkpoint, cfg.model, cfg.parallel)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    corpus = make_corpus(root / "corpus", num_docs=20)
    flags = model_flags("gpt2") + train_flags(corpus)
    cfg = parse_args(flags, env={})
    weights = {
        k: v[: cfg.model.vocab_size] if k == "embedding.word_embeddings.weight" else v
        for k, v in GPTModel(cfg.model).state_dict().items()
    }
    ck = write_checkpoint(
        str(root / "ck"), weights, cfg.model, tokenizer=dataclasses.asdict(cfg.tokenizer)
    )
    return flags, cfg, ck


def test_weights_only_checkpoint_needs_finetune(setup):
    flags, _, ck = setup
    with pytest.raises(UserError, match="weights-only checkpoint .* --finetune"):
        check(parse_args(flags + ["--load", ck], env={}))
    check(parse_args(flags + ["--load", ck, "--finetune"], env={}))
    with pytest.raises(UserError, match="cannot start a ZeRO-3 run"):
        check(parse_args(flags + ["--load", ck, "--finetune", "--zero-stage", "3"], env={}))


def test_shapes_compare_resolved_sizes(setup):
    flags, cfg, ck = setup
    # the default FFN size given explicitly is the same model
    same = ["--ffn-hidden-size", str(4 * cfg.model.hidden_size)]
    check(parse_args(flags + same + ["--load", ck, "--finetune"], env={}))
    other = ["--ffn-hidden-size", str(2 * cfg.model.hidden_size)]
    with pytest.raises(UserError, match=r"ffn_size=.*--ffn-hidden-size"):
        check(parse_args(flags + other + ["--load", ck, "--finetune"], env={}))
