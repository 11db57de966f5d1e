"""The GPT model: ModelConfig (config.py), GPTModel and its pipeline-stage parts (gpt.py)."""

from pretrain.model.config import ModelConfig
from pretrain.model.gpt import Embedding, FinalNormAndHead, GPTModel, TransformerLayer

__all__ = ["Embedding", "FinalNormAndHead", "GPTModel", "ModelConfig", "TransformerLayer"]
