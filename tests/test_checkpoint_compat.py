"""`--load` compatibility is decided before any process group exists: a converted (weights-only)
checkpoint needs --finetune, and model shapes are compared as resolved sizes, not raw flag values."""

import dataclasses

import pytest
from training_fixtures import make_corpus, model_flags, train_flags

from pretrain.cli import parse_args
from pretrain.convert.checkpoint_writer import write_checkpoint
from pretrain.errors import UserError
from pretrain.model import GPTModel
from pretrain.training.checkpoints.resume import check_before_launch


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


@pytest.mark.parametrize(
    "change, words",
    [
        (["--max-position-embeddings", "32"], ["max_positions=16 but this run has 32", "--max-position-embeddings"]),
        (["--seq-length", "32"], ["max_positions=16 but this run has 32"]),
        (["--make-vocab-size-divisible-by", "256"], ["128 rows", "pads to 256", "--make-vocab-size-divisible-by 64"]),
    ],
)  # fmt: skip
def test_shape_changes_are_one_line_before_launch(setup, change, words):
    """What DeepSpeed would report as a `size mismatch` traceback on every rank, after start-up."""
    flags, _, ck = setup
    with pytest.raises(UserError) as err:
        check(parse_args(flags + change + ["--load", ck, "--finetune"], env={}))
    assert all(w in str(err.value) for w in words), str(err.value)


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def test_a_megatron_checkpoint_in_load_names_the_converter(setup, tmp_path):
    flags, _, _ = setup
    megatron = tmp_path / "megatron"
    (megatron).mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("100")
    _touch(megatron / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt")
    with pytest.raises(
        UserError, match=r"Megatron-LM checkpoint .* tools/convert_from_megatron.py"
    ):
        check(parse_args(flags + ["--load", str(megatron)], env={}))
    deepspeed = tmp_path / "megatron_deepspeed"
    deepspeed.mkdir()
    (deepspeed / "latest").write_text("global_step5")
    _touch(deepspeed / "global_step5" / "mp_rank_00_model_states.pt")
    with pytest.raises(
        UserError, match=r"without pretrain_meta.json \(global_step5.*deepspeed_to_megatron"
    ):
        check(parse_args(flags + ["--load", str(deepspeed)], env={}))
