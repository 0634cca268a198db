"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from tqdm import tqdm

from tokenmill.config import EngineArgs
from tokenmill.engine.engine_args import create_engine_config
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, PreparedRequest, Prompt
from tokenmill.engine.messages import RequestTimings
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.pooling_config import ModelPooling
from tokenmill.engine.request_metrics import merge_request_metrics
from tokenmill.loader.hf import load_tokenizer
from tokenmill.lora.checker import AdapterChecker
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import ClassificationOutput, EmbeddingOutput, RequestOutput, ScoringOutput
from tokenmill.pooling_params import PoolingTask, check_dimensions, cosine, score_logit, truncate_embedding
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.request import Request, RequestStatus
from tokenmill.startup_phases import StartupPhases
from tokenmill.structured.llguidance_backend import llguidance_grammars

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Messages = list[dict[str, Any]]


class LLM:
    """An engine for offline batch generation. With no `model`, the embedded SmolLM2-135M-Instruct.

    Keyword arguments are those of `EngineArgs`: dtype, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, num_kv_blocks, kv_cache_memory_gb, gpu_memory_utilization,
    enable_prefix_caching, load_format ("auto" | "safetensors" | "gguf" | "dummy"), seed, device,
    attention_backend, scheduling_policy ("fcfs" | "priority"), quantization, enforce_eager (every
    layer from Python: no CUDA graphs, no fused CPU decode stack), generation_config ("auto": the
    model's generation_config.json sets the sampling defaults, "vllm": SamplingParams' own, or a folder),
    speculative_config (vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4}; a bad one is
    a ValueError here). Each finished RequestOutput's metrics count its draft and accepted tokens.

    Calls without `sampling_params` use `get_default_sampling_params()`.

    `shutdown()` (or leaving `with LLM(...) as llm:`) stops the engine; so does dropping the last
    reference to it. With tensor_parallel_size > 1 the ranks are processes started with "spawn": they
    import the main module again, so a script must create the LLM under `if __name__ == "__main__":`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        phases = StartupPhases(level=logging.DEBUG)  # where a slow start went, for whoever asks the logs
        with phases.phase("config"):
            self.config, source = create_engine_config(EngineArgs(model=model, **kwargs))
        with phases.phase("tokenizer"):
            self.tokenizer: PreTrainedTokenizerBase | None = (
                load_tokenizer(source.tokenizer) if source.tokenizer else None
            )
        vocab_size, eos = self.config.model.vocab_size, source.eos_token_ids
        # One compiler checks the requests and serves the engine: each grammar compiles once.
        grammars = llguidance_grammars(self.tokenizer, vocab_size, eos)
        self.engine = EngineCore(self.config, source, grammars, phases)
        phases.ready()
        lora = self.config.lora
        loras = AdapterChecker(self.config.model.hf_config, lora.max_lora_rank) if lora is not None else None
        self.inputs = InputProcessor(self.tokenizer, vocab_size, eos, self.engine.scheduler.limits, grammars, loras)
        self.pooling = ModelPooling.of(source.folder, self.config.model.hf_config)
        self._ids = itertools.count()
        # Holds the engine, not self: runs once, at shutdown(), when this LLM is garbage, or at exit.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine: its tensor-parallel ranks exit and this process leaves their group, so a new
        tensor-parallel LLM can start here. Later calls do nothing; generating afterwards raises."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (its generation_config.json, per `generation_config`)
        in place of SamplingParams' own: what `generate`, `chat` and `stream` use when given none."""
        return SamplingParams(**self.config.model.sampling_defaults)  # type: ignore[arg-type]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]}); outputs come
        back in prompt order. Every prompt is validated before any is queued. `cache_salt` (for every
        prompt; a dict prompt's own "cache_salt" otherwise) keeps their prefix-cache blocks apart from
        other salts'. `lora_request`: the LoRA adapter for every prompt, or one per prompt (None: the
        base model); requests for different adapters and the base share steps."""
        if self.pooling.classifier:
            raise ValueError("this model is a classifier (*ForSequenceClassification): use score or classify.")
        prompt_list = _as_prompt_list(prompts)
        params = _broadcast(sampling_params or self.get_default_sampling_params(), len(prompt_list), "sampling_params")
        priorities = _broadcast(list(priority) if priority is not None else 0, len(prompt_list), "priority")
        loras = _broadcast(lora_request, len(prompt_list), "lora_request")
        prepared = [
            self.inputs.process(str(next(self._ids)), p, sp, prio, cache_salt=cache_salt, lora_request=lora)
            for p, sp, prio, lora in zip(prompt_list, params, priorities, loras)
        ]
        return self._run(prepared, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with `tools`, OpenAI's tool objects,
        and `chat_template_kwargs`, the template's extra variables such as enable_thinking, if given),
        then generate. Messages are tokenized as the server tokenizes them: text inside a message that
        spells a control token stays text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[Prompt] = [
            {
                "prompt_token_ids": self.inputs.chat_token_ids(
                    conv,  # type: ignore[arg-type]
                    add_generation_prompt,
                    tools,
                    chat_template_kwargs,
                )
            }
            for conv in conversations
        ]
        return self.generate(
            prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt, lora_request=lora_request
        )

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        chat: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (`delta_text` holds the new
        text); with chat=True the prompt is a list of messages."""
        params = sampling_params or self.get_default_sampling_params()
        if chat:
            prompt = {"prompt_token_ids": self.inputs.chat_token_ids(prompt)}  # type: ignore[arg-type]
        request = self.inputs.process(
            str(next(self._ids)), prompt, params, cache_salt=cache_salt, lora_request=lora_request
        )
        yield from self._iterate([request])

    # ------------------------------------------------------------------ pooling
    def embed(
        self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None, *, use_tqdm: bool = False
    ) -> list[EmbeddingOutput]:
        """Each prompt's embedding: the final hidden state pooled as the model folder's
        sentence-transformers config says (else the last token), L2-normalized; with `dimensions`, its
        first values normalized again. The prompts are prefilled with any other traffic and keep no KV."""
        check_dimensions(dimensions, self.pooling.hidden_size)
        results = self._pool(prompts, "embed", use_tqdm)
        return [
            EmbeddingOutput(r.request_id, r.prompt_token_ids, truncate_embedding(r.pooled or [], dimensions))
            for r in results
        ]

    def classify(self, prompts: Prompt | Sequence[Prompt], *, use_tqdm: bool = False) -> list[ClassificationOutput]:
        """A *ForSequenceClassification model's logits on each prompt (its last token)."""
        return [
            ClassificationOutput(r.request_id, r.prompt_token_ids, r.pooled or [])
            for r in self._pool(prompts, "classify", use_tqdm)
        ]

    def score(self, text_1: str, text_2: str | Sequence[str], *, use_tqdm: bool = False) -> list[ScoringOutput]:
        """How well each of `text_2` goes with `text_1`. With a classification head (one label): its
        logit on the pair, tokenized as the tokenizer joins a pair (method "classification"); otherwise
        the cosine similarity of their embeddings (method "cosine")."""
        texts = [text_2] if isinstance(text_2, str) else list(text_2)
        if not texts:
            raise ValueError("score needs at least one text_2.")
        if self.pooling.classifier:
            pairs: list[Prompt] = [self.inputs.pair_token_ids(text_1, t) for t in texts]
            results = self._pool(pairs, "classify", use_tqdm)
            return [ScoringOutput(score_logit(r.pooled), "classification", len(r.prompt_token_ids)) for r in results]
        first, *rest = self._pool([text_1, *texts], "embed", use_tqdm)
        return [
            ScoringOutput(
                cosine(first.pooled, r.pooled), "cosine", len(first.prompt_token_ids) + len(r.prompt_token_ids)
            )
            for r in rest
        ]

    def _pool(self, prompts: Prompt | Sequence[Prompt], task: PoolingTask, use_tqdm: bool) -> list[RequestOutput]:
        params = self.pooling.params(task)
        prepared = [self.inputs.process_pooling(str(next(self._ids)), p, params) for p in _as_prompt_list(prompts)]
        results = self._run(prepared, use_tqdm)
        for result in results:
            if result.error is not None or result.pooled is None:
                raise RuntimeError(f"pooling request {result.request_id} failed: {result.error}")
        return results

    # ------------------------------------------------------------------ the step loop
    def _run(self, prepared: list[PreparedRequest], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prepared), desc="generate", unit="req", disable=not use_tqdm)
        start, num_out = time.perf_counter(), 0
        for result in self._iterate(prepared, only_finished=True):
            num_out += sum(len(o.token_ids) for o in result.outputs)
            finished[result.request_id] = result
            bar.update(1)
            bar.set_postfix(out_tok_s=f"{num_out / max(time.perf_counter() - start, 1e-9):.1f}", refresh=False)
        bar.close()
        return [finished[req.request_id] for req in prepared]

    def _iterate(self, prepared: list[PreparedRequest], only_finished: bool = False) -> Iterator[RequestOutput]:
        """Queue the requests, then step the engine until all have finished, yielding each update
        (`only_finished`: each finished request's output alone, built once)."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down: create a new one.")
        processor = OutputProcessor(self.tokenizer)
        children: dict[str, list[Request]] = {}
        for req in prepared:
            processor.add_request(
                req.request_id,
                req.prompt,
                req.prompt_token_ids,
                req.params,
                [c.req_id for c in req.children],
                pooling=req.pooling_params is not None,
            )
            for child in req.children:
                self.engine.add_request(child)
            children[req.request_id] = req.children
        remaining = len(prepared)
        try:
            while remaining:
                results, to_stop = processor.process(self.engine.step(), only_finished)
                for child_id in to_stop:
                    self.engine.abort_request(child_id, RequestStatus.FINISHED_STOPPED)
                for result in results:
                    if result.finished:
                        kids = children[result.request_id]
                        timings = [RequestTimings.of(c) for c in kids]
                        result.metrics = merge_request_metrics(kids[0].arrival_time, timings)
                        remaining -= 1
                    yield result
        finally:  # a caller that stops iterating early must not leave requests holding blocks
            for kids in children.values():
                for child in kids:
                    if not child.is_finished:
                        self.engine.abort_request(child.req_id)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if not items:
        raise ValueError("no prompts given.")
    token_ids = [t for t in items if isinstance(t, int)]
    if len(token_ids) == len(items):
        return [token_ids]  # a single token-id list
    prompt_list: list[Prompt] = []
    for item in items:
        if isinstance(item, int):  # ids mixed with prompts
            raise ValueError("a prompt must be a string or a list of token ids, got int.")
        prompt_list.append(item)
    return prompt_list


T = TypeVar("T")


def _broadcast(value: T | Sequence[T], n: int, name: str) -> list[T]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts.")
        return list(value)
    return [cast(T, value)] * n  # not a list or tuple: one value (mypy cannot rule out that T is a sequence)
