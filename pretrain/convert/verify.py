"""Check an export: our GPTModel and the transformers model compute the same logits and loss.

Both run in fp32 on the same token batch. Our logits at the padded vocabulary ids (which the export
drops) are -inf and left out of the logit comparison; the loss is the language-model loss on the
batch (next-token cross entropy, mean over tokens), ours as training computes it and transformers'
from `labels`. Padding never enters our softmax, so the two losses agree to fp32 rounding. A greedy
`generate` from the exported model then shows that it also works as a text generator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import transformers

from pretrain.convert.state_dict import pad_vocab
from pretrain.model.config import ModelConfig
from pretrain.model.gpt import GPTModel

LOGIT_TOLERANCE = 1e-4  # fp32, absolute
LOSS_TOLERANCE = 1e-6  # fp32, relative


@dataclass
class Verification:
    """What `compare_logits` found on one token batch."""

    max_abs_diff: float  # largest |our logit - transformers' logit| over the real vocabulary
    tokens: torch.Tensor  # the batch [b, s]
    our_loss: float  # our training loss on the batch (mean next-token cross entropy)
    hf_loss: float  # transformers' loss on the same batch (`labels=tokens`)

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.our_loss - self.hf_loss) / max(abs(self.our_loss), 1e-12)

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= LOGIT_TOLERANCE and self.loss_rel_diff <= LOSS_TOLERANCE

    def report(self) -> str:
        """Two lines for the converter's output."""
        return (
            f"verify: max abs logit difference {self.max_abs_diff:.3e} over "
            f"{tuple(self.tokens.shape)} tokens (tolerance {LOGIT_TOLERANCE:.0e}, fp32)\n"
            f"verify: lm loss {self.our_loss:.6f} (ours) vs {self.hf_loss:.6f} (transformers), "
            f"relative difference {self.loss_rel_diff:.1e} (tolerance {LOSS_TOLERANCE:.0e})"
        )

    def failure(self) -> str:
        """Why `ok` is False, in one line."""
        return (
            f"our model and transformers differ: logits by {self.max_abs_diff:.3e} "
            f"(tolerance {LOGIT_TOLERANCE:.0e}), loss by {self.loss_rel_diff:.1e} relative "
            f"(tolerance {LOSS_TOLERANCE:.0e})"
        )


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
    """Logits and loss of both models on `tokens` [b, s] (fp32)."""
    our_logits = ours(tokens, gather_logits=True).float()  # real vocabulary only
    hf_out = hf.float()(tokens, labels=tokens)  # transformers shifts the labels itself
    our_loss = ours(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    return Verification(
        max_abs_diff=float((our_logits - hf_out.logits.float()).abs().max()),
        tokens=tokens,
        our_loss=float(our_loss),
        hf_loss=float(hf_out.loss),
    )


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
