"""`checkpoint.format.resume_record`: everything a resume decides by, read from a checkpoint's
metadata in one call, with the defaults of older and converted checkpoints."""

from pretrain.checkpoint.format import build_metadata, resume_record
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig

MODEL = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16)


def meta(**extra) -> dict:
    parallel = ParallelConfig(tensor_model_parallel_size=2, world_size=4, zero_stage=1)
    return build_metadata(
        iteration=3,
        consumed_train_samples=12,
        consumed_valid_samples=0,
        model=MODEL,
        parallel=parallel,
        pipeline_engine=False,
        tokenizer={},
        **extra,
    )


def test_a_training_checkpoint_gives_its_layout_precision_and_contents():
    saved = resume_record(meta(precision={"bf16": True, "fp16": False}, full_state=False))
    assert (saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size) == (2, 1)
    assert (saved.data_parallel_size, saved.zero_stage) == (2, 1)
    assert (saved.backend, saved.sharding, saved.precision) == ("deepspeed", "ZeRO-1", "bf16")
    assert not saved.full_state and not saved.full_state_only and not saved.weights_only
    assert saved.padded_vocab_size == MODEL.padded_vocab_size(2)
    assert saved.vocab_size == 16


def test_an_older_or_converted_checkpoint_gets_the_defaults():
    old = meta(weights_only=True)
    del old["parallel"]["backend"], old["parallel"]["expert_model_parallel_size"]
    saved = resume_record(old)
    assert (saved.backend, saved.expert_model_parallel_size) == ("deepspeed", 1)
    assert saved.precision is None  # not recorded: not compared
    assert saved.full_state and saved.weights_only
