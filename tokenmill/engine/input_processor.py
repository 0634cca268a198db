"""Prompt in, validated core Requests out: tokenization, limits, and the n > 1 fan-out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.engine.chat_template import chat_prompt_token_ids
from tokenmill.engine.request_limits import NO_CAPS, RequestCaps, check_pooling_prompt, resolve_max_tokens
from tokenmill.lora.checker import AdapterChecker
from tokenmill.lora_request import LoRARequest
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.request import Request
from tokenmill.scheduling.scheduler import AdmissionLimits
from tokenmill.structured.backend import GrammarChecker
from tokenmill.structured.llguidance_backend import LLGuidanceChecker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Text, token ids, or {"prompt": ..., "prompt_token_ids": [...]} as a user sent it (checked here).
Prompt = str | list[int] | dict[str, Any]


@dataclass
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens resolved
    children: list[Request]
    pooling_params: PoolingParams | None = None  # a pooling request: its one child pools, never samples


# What a pooling request carries as sampling params: they are never used (it never samples).
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def check_cache_salt(cache_salt: object) -> None:
    """A cache salt is a non-empty string, or None (as vLLM: an empty one is an error, not "no salt")."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt must be a non-empty string if given.")


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        eos_token_ids: list[int],
        limits: AdmissionLimits,
        grammars: GrammarChecker | None = None,
        loras: AdapterChecker | None = None,
    ) -> None:
        """`grammars` checks structured_outputs: the engine's own compiler where the engine runs in this
        process (LLM: the engine's compile is then a cache hit), else a check without the tokenizer
        (the engine, in its process, compiles each grammar once). `loras` checks a request's LoRA
        adapter against the base model once (None: the engine serves no adapters)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = limits
        self.grammars = grammars if grammars is not None else LLGuidanceChecker(tokenizer)
        self.loras = loras

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give some text or token ids.")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token id lists.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}.")

    def _check_ids(self, ids: object) -> list[int]:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt token ids must be a list of integers.")
        if not ids:
            raise ValueError("the prompt is empty; give at least one token id.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}).")
        return list(ids)

    def pair_token_ids(self, text_1: str, text_2: str) -> list[int]:
        """Two texts as one input, joined as the tokenizer joins a pair (a cross-encoder's input)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: scoring needs one.")
        if not text_1 or not text_2:
            raise ValueError("both texts to score must be non-empty.")
        return list(self.tokenizer(text_1, text_2)["input_ids"])

    def chat_token_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """A conversation's prompt token ids through the model's chat template (chat_template.py: the
        path the server takes too); ValueError if the model has none or the template refuses them."""
        return chat_prompt_token_ids(self.tokenizer, messages, add_generation_prompt, tools, template_kwargs)

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        caps: RequestCaps = NO_CAPS,
        lora_request: LoRARequest | None = None,
    ) -> PreparedRequest:
        """Validate everything before anything is queued: a bad request raises ValueError and
        leaves the engine untouched. `lora_request`: the adapter to run with (checked here: its files,
        rank and shapes), None for the base model. `cache_salt` keeps the request's prefix-cache blocks apart from
        those of requests with another salt (or none); a dict prompt may carry its own "cache_salt".
        max_tokens is resolved here, once (request_limits.py): None takes the caps' default, or the
        room the prompt leaves; min_tokens is clamped to it."""
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        check_cache_salt(cache_salt)
        self.check_lora(lora_request)
        if prompt_token_ids is None:
            text, ids = self.tokenize(prompt)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), self._check_ids(prompt_token_ids)
        params.check_vocab(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids).")
        max_tokens = resolve_max_tokens(self.limits, len(ids), params.max_tokens, caps)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)  # a bad schema, regex or grammar: ValueError
        children = self._fan_out(request_id, ids, params, priority, cache_salt)
        for child in children:
            child.lora_request = lora_request
        return PreparedRequest(request_id, text, ids, params, children)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """A ValueError unless `lora_request` is None or an adapter this engine can serve."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora).")
        self.loras.check(lora_request)

    def process_pooling(
        self,
        request_id: str,
        prompt: Prompt,
        pooling_params: PoolingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        caps: RequestCaps = NO_CAPS,
    ) -> PreparedRequest:
        """A pooling request (an embedding, a classification), validated like `process`: it is
        prefilled, never samples, and ends with its pooled vector once its prompt is computed."""
        check_cache_salt(cache_salt)
        text, ids = self.tokenize(prompt)
        check_pooling_prompt(self.limits, len(ids), caps)
        child = Request(
            request_id,
            ids,
            POOLING_SAMPLING,
            self.eos_token_ids,
            priority,
            cache_salt=cache_salt,
            pooling_params=pooling_params,
        )
        return PreparedRequest(request_id, text, ids, POOLING_SAMPLING, [child], pooling_params)

    def _fan_out(
        self, request_id: str, ids: list[int], params: SamplingParams, priority: int, cache_salt: str | None = None
    ) -> list[Request]:
        """n samples of one prompt become n core requests; the siblings wait for the first to compute
        the prompt, then reuse its KV blocks through the prefix cache.

        Only the first computes prompt logprobs (the same for every sample; the OutputProcessor gives
        them to all): a request that wants them must compute every prompt position, so it skips the
        prefix cache, and the siblings would each compute the whole prompt again. (With the prefix
        cache off the siblings still compute the prompt, but without logprobs.)"""
        if params.n == 1:
            return [Request(request_id, ids, params, self.eos_token_ids, priority, cache_salt=cache_salt)]
        children: list[Request] = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            prompt_logprobs = params.prompt_logprobs if i == 0 else None
            child_params = dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
            leader = children[0] if children else None
            children.append(
                Request(
                    f"{request_id}#{i}",
                    ids,
                    child_params,
                    self.eos_token_ids,
                    priority,
                    prefill_leader=leader,
                    cache_salt=cache_salt,
                )
            )
        return children
