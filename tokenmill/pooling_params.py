"""Per-request pooling settings: a request with these is prefilled, never samples, and ends with its
prompt's pooled hidden state (an embedding) or a classification head's output on it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

PoolingType = Literal["LAST", "MEAN", "CLS"]
PoolingTask = Literal["embed", "classify"]
POOLING_TYPES: tuple[PoolingType, ...] = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolingParams:
    """task "embed": the final hidden state (after the last norm) pooled over the prompt: LAST token,
    MEAN of every token, or the first (CLS); L2-normalized if `normalize`. task "classify": the model's
    classification head (a *ForSequenceClassification model) on the last token's hidden state, raw
    logits (what transformers' model returns)."""

    task: PoolingTask = "embed"
    pooling_type: PoolingType = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify"):
            raise ValueError(f"pooling task must be 'embed' or 'classify', got {self.task!r}.")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.")

    @property
    def needs_every_token(self) -> bool:
        """MEAN reads every prompt position and CLS the first: a prefix-cache hit would skip them."""
        return self.pooling_type != "LAST"


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    """ValueError unless `dimensions` (None: all) is in [1, hidden_size]."""
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise ValueError(f"dimensions must be between 1 and the model's {hidden_size}, got {dimensions}.")


def truncate_embedding(embedding: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, L2-normalized again (as Matryoshka embeddings are read); the whole
    vector when None. ValueError when `dimensions` is outside [1, len(embedding)]."""
    if dimensions is None:
        return embedding
    check_dimensions(dimensions, len(embedding))
    head = embedding[:dimensions]
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def score_logit(logits: list[float] | None) -> float:
    """A one-label classifier's score: its logit (what transformers' model returns)."""
    if not logits or len(logits) != 1:
        raise ValueError(f"scoring needs a classifier with one label; this one has {len(logits or [])}.")
    return logits[0]


def cosine(a: list[float] | None, b: list[float] | None) -> float:
    """The cosine similarity of two L2-normalized embeddings: their dot product."""
    return sum(x * y for x, y in zip(a or [], b or []))
