"""*ForSequenceClassification models (Llama, Mistral, Qwen2, Qwen3): the causal LM's body with a `score`
Linear in place of the LM head, read on the last token's hidden state (transformers' convention). They
serve pooling requests only (tokenmill.pooling_params, task "classify")."""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.models.llama import LlamaForCausalLM


class LlamaForSequenceClassification(LlamaForCausalLM):
    def __init__(self, hf_config: Any, backend: AttentionBackend, max_position: int) -> None:
        super().__init__(hf_config, backend, max_position)
        self.lm_head = None  # no LM head in the checkpoint: the score head replaces it
        # Replicated on every tensor-parallel rank: num_labels is a handful of rows.
        self.score = nn.Linear(hf_config.hidden_size, int(hf_config.num_labels), bias=False)
