"""A request as the scheduler sees it: token ids, progress, blocks and status. No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.lora_request import LoRARequest
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

# The idle class (the Batch API's lines): a request at this priority is computed only in steps that no
# other request wants, under every scheduling policy; it keeps its blocks meanwhile unless a waiting
# request needs them (then it is preempted). Online traffic thus never shares a step with it.
BACKGROUND_PRIORITY = (1 << 31) - 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    """One sequence to generate. `num_computed_tokens` catches up with `num_tokens` step by step."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # For n > 1: the sibling that computes the shared prompt first; this one waits for it so that
    # it finds the prompt's blocks in the prefix cache instead of computing them again.
    prefill_leader: Request | None = None
    # Mixed into the hash of the first block (later blocks chain from it): requests with different
    # salts never share prefix-cache blocks, those with the same salt do. None: no salt.
    cache_salt: str | None = None
    # A pooling request (an embedding, a classification): prefilled, never samples, and finishes with
    # its pooled hidden state once the prompt is computed.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter the request runs with (None: the base model); its prefix-cache blocks are its own.
    lora_request: LoRARequest | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling: tokens sampled by steps still in flight (their values not yet known here), and
    # the outputs of in-flight steps to drop when they come (the request was preempted since).
    num_output_placeholders: int = 0
    num_stale_outputs: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    kv_tier_checked: bool = False  # the second KV tier was looked up for it (once per request: scheduling/kv_tier.py)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Speculative decoding: drafts to verify next step (set from the runner's proposals), and the
    # totals verified and accepted over the request's life.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def background(self) -> bool:
        return self.priority >= BACKGROUND_PRIORITY

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def max_tokens(self) -> int:
        # None is resolved by the engine before the request reaches the scheduler.
        assert self.sampling_params.max_tokens is not None
        return self.sampling_params.max_tokens

    @property
    def num_reserved_tokens(self) -> int:
        """Tokens past the prompt the request may need room for: none for a pooling request."""
        return 0 if self.pooling_params is not None else self.max_tokens

    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def check_stop(self, new_token: int) -> RequestStatus | None:
        """The finished status that `new_token` (just appended) leads to, or None to go on.

        Under a grammar (structured_outputs), eos is the grammar's end, its only token once the output
        is complete: it stops the request whatever ignore_eos and min_tokens say."""
        params = self.sampling_params
        constrained = params.structured_outputs is not None
        if constrained or self.num_output_tokens >= params.min_tokens:
            if (constrained or not params.ignore_eos) and new_token in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if new_token in params.stop_token_ids:
                self.stop_reason = new_token
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
