"""The plain dataclasses that cross layer boundaries.

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler --> RequestOutput --> caller.
None of these hold tensors, so `core/` stays free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.lora_request import LoRARequest
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# token id -> its logprob; one of these per position.
TokenLogprobs = dict[int, Logprob]


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state was dropped)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # KV layer groups 1, 2, ... (sliding-window layers: tokenmill/kv_groups.py): each one's block ids.
    group_block_ids: list[list[int]] = field(default_factory=list)
    pooling_params: PoolingParams | None = None  # a pooling request: never sampled
    lora_request: LoRARequest | None = None  # the adapter its rows run with (None: the base model)


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_group_block_ids: list[list[int]] = field(default_factory=list)  # KV layer groups 1, 2, ...


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    # Requests that ended (finished, aborted or preempted) since the last step: the runner drops them.
    finished_req_ids: set[str] = field(default_factory=set)
    # req_id -> the draft tokens it verifies this step (speculative decoding): the last
    # len(drafts) of its num_scheduled_tokens, after its last committed token.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The second KV tier (tokenmill/kv_tier): (block id, block hash) of cached blocks evicted by this step's
    # allocations, to copy out before the step's forward writes over them; tier blocks (fetched and checked
    # already) to write into free pool blocks before the forward; and hashes the tier drops (its LRU).
    kv_saves: list[tuple[int, bytes]] = field(default_factory=list)
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)
    kv_deletes: list[bytes] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing for the model to compute (tier transfers may still be due: has_kv_transfers)."""
        return self.total_num_scheduled_tokens == 0

    @property
    def has_kv_transfers(self) -> bool:
        return bool(self.kv_saves or self.kv_loads or self.kv_deletes)


@dataclass
class ModelRunnerOutput:
    # Only requests whose prompt is fully computed get tokens; a partial prefill chunk samples nothing.
    # One token per request, or with draft tokens: the accepted drafts then the target's own token
    # (the correction at the first rejection, or a bonus token when every draft was accepted).
    sampled_token_ids: dict[str, list[int]]
    # req_id -> top-k logprobs of each sampled position (the sampled token always included).
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> one entry per prompt position computed this step (None for the first prompt token).
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for its next step (speculative decoding); the scheduler may cut them.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the pooled vector of a pooling request whose prompt this step completed.
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # Speculative decoding: draft tokens verified for this request, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    delta_text: str = ""  # the text this update added (for streaming)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request ended because of an error
    # A pooling request's result: the pooled embedding (or the classification head's logits).
    pooled: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """LLM.embed's result for one input: its pooled, L2-normalized final hidden state."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


@dataclass
class ClassificationOutput:
    """LLM.classify's result: the classification head's logits on the input's last token."""

    request_id: str
    prompt_token_ids: list[int]
    logits: list[float]


@dataclass
class ScoringOutput:
    """LLM.score's result for one (text_1, text_2) pair. method "classification": the head's logit on
    the pair, as one input; "cosine": the cosine similarity of the two texts' embeddings."""

    score: float
    method: str
    num_prompt_tokens: int


@dataclass
class EngineCoreOutput:
    """What one step changed for one request, from the scheduler to the engine's output side."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one entry per new token
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    pooled: list[float] | None = None  # a pooling request's result, with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
