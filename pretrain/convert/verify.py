"""Check an export: our GPTModel and the transformers model compute the same logits.

Both run in fp32 on the same token batch; the padded vocabulary columns of our logits (which the
export drops) are left out of the comparison. A greedy `generate` from the exported model then
shows that it also works as a text generator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import transformers

from pretrain.convert.state_dict import pad_vocab
from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel

LOGIT_TOLERANCE = 1e-4  # fp32


@dataclass
class Verification:
    max_abs_diff: float
    tokens: torch.Tensor

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= LOGIT_TOLERANCE


def our_model(ours: dict[str, torch.Tensor], config: ModelConfig) -> GPTModel:
    """A one-process (TP = 1) fp32 GPTModel holding the full, unpadded state dict `ours`."""
    config = dataclasses.replace(
        config, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0
    )
    model = GPTModel(config)
    weights = {k: v.float() for k, v in pad_vocab(ours, config.padded_vocab_size(1)).items()}
    model.load_state_dict(weights, strict=True)
    return model.eval()


def token_batch(
    config: ModelConfig, batch: int = 2, length: int = 64, seed: int = 1234
) -> torch.Tensor:
    """Seeded random token ids of the real vocabulary, short enough for the model."""
    length = min(length, config.seq_length, config.max_positions)
    return torch.randint(
        0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)
    )


@torch.no_grad()
def compare_logits(
    ours: GPTModel, hf: transformers.PreTrainedModel, tokens: torch.Tensor
) -> Verification:
    """Max absolute difference between our logits and the HF model's on `tokens`."""
    vocab = ours.config.vocab_size
    our_logits = ours(tokens)[..., :vocab].float()
    hf_logits = hf.float()(tokens).logits.float()
    return Verification(float((our_logits - hf_logits).abs().max()), tokens)


@torch.no_grad()
def greedy_generate(
    hf: transformers.PreTrainedModel, prompt_ids: list[int], max_new_tokens: int
) -> list[int]:
    """Greedy continuation of `prompt_ids` (only the new ids)."""
    inputs = torch.tensor([prompt_ids])
    out = hf.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=hf.generation_config.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()
