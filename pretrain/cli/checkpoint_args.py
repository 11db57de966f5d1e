"""`--use-checkpoint-args`: the model flags from the `--load` checkpoint, by Megatron's rules.

Megatron-LM (`load_args_from_checkpoint`) reads the arguments a checkpoint recorded and sets
them in two ways: the size flags whose default is None (`FILLED`) take the checkpoint's value
only where the command line did not give one; the others (`FORCED`) take the checkpoint's value
even over the command line. Here the checkpoint's record is the `ModelConfig` in its
`pretrain_meta.json`; `FORCED` also holds the fields Megatron leaves to the command line but
which change this model's function (norm epsilon, GELU flavour, RoPE scaling, vocabulary
padding). Every value the checkpoint changes is said in one line; no checkpoint in `--load` means
the command line's flags, as in Megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from pretrain.checkpoint.format import refuse_foreign_checkpoint
from pretrain.checkpoint.load_target import choose_load
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig, flag_for

# ModelConfig field -> namespace dest, for the fields filled only where the command line is silent
FILLED = {
    "num_layers": "model__num_layers",
    "hidden_size": "model__hidden_size",
    "ffn_hidden_size": "model__ffn_hidden_size",
    "seq_length": "seq_length",
    "num_attention_heads": "model__num_attention_heads",
    "kv_channels": "model__kv_channels",
    "max_position_embeddings": "model__max_position_embeddings",
}
FORCED = (
    "num_query_groups",
    "position_embedding_type",
    "rotary_base",
    "add_bias_linear",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "normalization",
    "attention_dropout",
    "hidden_dropout",
    "make_vocab_size_divisible_by",
    "norm_epsilon",
    "openai_gelu",
    "use_rope_scaling",
    "rope_scaling_factor",
    "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
)


def saved_model(ns: argparse.Namespace, say: Callable[[str], None]) -> dict | None:
    """The "model" record of the checkpoint `--load` resumes from; None (said) when there is
    none yet. Refuses --use-checkpoint-args without --load, as Megatron does."""
    if ns.checkpoint__load is None:
        raise UserError(
            "--use-checkpoint-args needs --load (the checkpoint to read the model from)"
        )
    refuse_foreign_checkpoint(ns.checkpoint__load)  # a Megatron-LM one: the converter to use
    choice = choose_load(ns.checkpoint__load, ns.checkpoint__save)
    if choice is None:
        say(
            f"--use-checkpoint-args: no checkpoint in --load {ns.checkpoint__load} yet; using the "
            f"command line's model flags"
        )
        return None
    return choice.meta["model"]


def fill_from_checkpoint(ns: argparse.Namespace, saved: dict, say: Callable[[str], None]) -> None:
    """Set, in `ns`, each `FILLED` size the command line did not give to the checkpoint's."""
    for name, dest in FILLED.items():
        if getattr(ns, dest) is None and saved.get(name) is not None:
            setattr(ns, dest, saved[name])
            say(f"--use-checkpoint-args: {flag_for(name)} {saved[name]} from the checkpoint")


def force_from_checkpoint(
    model: ModelConfig, saved: dict, say: Callable[[str], None]
) -> ModelConfig:
    """`model` with every `FORCED` field the checkpoint records set to the checkpoint's value,
    one line per value that differs from the command line's."""
    changes = {}
    for name in FORCED:
        if name in saved and saved[name] != getattr(model, name):
            changes[name] = saved[name]
            say(
                f"--use-checkpoint-args: {name}={saved[name]} from the checkpoint "
                f"({flag_for(name)}; the command line gave {getattr(model, name)})"
            )
    return dataclasses.replace(model, **changes)
