"""How the GPT is cut into pipeline layers and stages, as pipeline checkpoints name them.

DeepSpeed's pipeline engine saves one file per pipeline layer index: index 0 the embedding, 1 .. L
the transformer layers, L + 1 the head (final norm, and the output layer when untied), L + 2 the
tied embedding copy of the last stage (tied embeddings only; `tied_modules.<TIED_KEY>.` in the
module's names). The converters read and write those files, the DeepSpeed backend names its
parameters through them, and the re-sharder places each parameter on its stage.
"""

from __future__ import annotations

TIED_KEY = "embed"
TIED_WEIGHT = "word_embeddings.weight"


def layer_name_prefix(index: int, num_layers: int) -> str | None:
    """GPTModel state-dict prefix of pipeline layer `index` (None for the tied copy)."""
    if index == 0:
        return "embedding."
    if index <= num_layers:
        return f"layers.{index - 1}."
    if index == num_layers + 1:
        return "head."
    return None


def stage_of_parameter(name: str, num_layers: int, pp: int) -> int:
    """The pipeline stage that owns GPTModel parameter `name` at `pp` stages: the embedding the
    first, `layers.<i>` stage i // (L / pp) (`validate` requires pp to divide L, so the balanced
    split is even), the head the last."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("head."):
        return pp - 1
    return int(name.split(".", 2)[1]) // (num_layers // pp)
