"""The wire models of POST /v1/embeddings (OpenAI's shape), POST /v1/score and POST /v1/rerank (the
Cohere / Jina rerank shape, as vLLM serves it). Strict like every request model (strict.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.server.protocol import PositiveInt, Priority, TokenId
from tokenmill.server.strict import RequestBody, StrictModel

Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# "classification": a *ForSequenceClassification head's output on the pair, read as one input;
# "cosine": the cosine similarity of the two texts' embeddings (a model without such a head).
ScoreMethod = Literal["classification", "cosine"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------- /v1/embeddings
class EmbeddingRequest(RequestBody):
    input: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    model: str | None = Field(default=None, description="The served model's id (see /v1/models).")
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description='"base64": each embedding as little-endian float32 bytes, base64-encoded.'
    )
    dimensions: PositiveInt | None = Field(
        default=None, description="Keep the first values of each embedding, L2-normalized again (at most the model's)."
    )
    user: str | None = None
    priority: Priority = 0
    cache_salt: Text | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs, one per embedding: a string, a token-id list, or a list of either."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            return [given]
        return list(given)  # type: ignore[arg-type]


class EmbeddingData(_Out):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Out):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ---------------------------------------------------------------------- /v1/score and /v1/rerank
class ScoreRequest(RequestBody):
    """text_1 against each of text_2 (one text_1, or as many as text_2, paired in order)."""

    model: str | None = None
    text_1: Text | Annotated[list[Text], Field(min_length=1)]
    text_2: Text | Annotated[list[Text], Field(min_length=1)]
    priority: Priority = 0


class ScoreData(_Out):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(_Out):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    method: ScoreMethod
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(StrictModel):
    text: Text


class RerankRequest(RequestBody):
    model: str | None = None
    query: Text
    documents: Annotated[list[Text | RerankDocument], Field(min_length=1)]
    top_n: PositiveInt | None = Field(default=None, description="Return only the best top_n (default: all).")
    return_documents: bool = True
    priority: Priority = 0

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResultDocument(_Out):
    text: str


class RerankResult(_Out):
    index: int
    relevance_score: float
    document: RerankResultDocument | None = None


class RerankUsage(_Out):
    total_tokens: int


class RerankResponse(_Out):
    id: str
    model: str
    method: ScoreMethod
    results: list[RerankResult]
    usage: RerankUsage
