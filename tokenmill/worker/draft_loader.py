"""Load the draft model of speculative decoding ("draft_model"), checked against the target."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.loader.hf import load_tokenizer
from tokenmill.loader.model_source import ModelSource, resolve_source
from tokenmill.loader.presets import PRESETS
from tokenmill.worker.model_loader import load_model


def draft_model_config(config: EngineConfig) -> tuple[ModelConfig, ModelSource]:
    """The draft's ModelConfig: its own weights and shapes, the target's precision, quantization and
    context length. A ValueError says what to change when the draft cannot serve the target."""
    spec = config.speculative
    if spec is None or spec.model is None:
        raise ValueError("no draft model is configured")
    target = config.model
    # A preset name (not a path) loads random weights of that shape: for tests and benchmarks.
    load_format = "dummy" if spec.model in PRESETS and not Path(spec.model).exists() else "auto"
    source = resolve_source(spec.model, load_format)
    vocab_size = int(source.hf_config.vocab_size)
    if vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {vocab_size} tokens, the target "
            f"{target.model!r} {target.vocab_size}: a draft must share the target's tokenizer."
        )
    if source.tokenizer is not None and target.tokenizer is not None and source.tokenizer != target.tokenizer:
        if load_tokenizer(source.tokenizer).get_vocab() != load_tokenizer(target.tokenizer).get_vocab():
            raise ValueError(
                f"the draft model {spec.model!r} and the target {target.model!r} have the same vocabulary size "
                "but different tokens: a draft must share the target's tokenizer."
            )
    max_positions = int(getattr(source.hf_config, "max_position_embeddings", 0) or target.max_model_len)
    if max_positions < target.max_model_len:
        raise ValueError(
            f"the draft model {spec.model!r} takes {max_positions} positions, fewer than max_model_len "
            f"{target.max_model_len}; lower --max-model-len."
        )
    draft = dataclasses.replace(
        target,
        model=spec.model,
        hf_config=source.hf_config,
        load_format=load_format,
        tokenizer=source.tokenizer,
        sampling_defaults={},
    )
    return draft, source


def load_draft_model(config: EngineConfig, backend: AttentionBackend) -> tuple[nn.Module, ModelConfig]:
    draft, source = draft_model_config(config)
    return load_model(draft, source.folder, backend, config.device), draft
