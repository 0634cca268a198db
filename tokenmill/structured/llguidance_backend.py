"""The llguidance backend: specs become llguidance grammars, compiled once into a matcher at the start
that each request copies."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.compile_threads import COMPILE_THREADS
from tokenmill.structured.compiler import GrammarCompiler, spec_key

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# JSON on one line, with or without a space after ':' and ',': unbounded whitespace (llguidance's
# default) lets a weak model emit blank lines forever. A schema with its own "x-guidance" options
# (llguidance's) gets those instead.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": "[ ]?"}
# Specs a front end remembers as valid (a key each): a client resending its schema is checked once.
CHECKED_CAPACITY = 1024


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for `spec` (not yet checked: compiling it does that)."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        # Ours would win over the schema's options: our whitespace_pattern over its whitespace_flexible.
        own_options = isinstance(schema, dict) and "x-guidance" in schema
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=None if own_options else _JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # Lark string literals take JSON's escapes: quotes, backslashes and newlines stay literal.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None  # StructuredOutputsParams holds exactly one
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def llguidance_grammars(
    tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_ids: list[int]
) -> GrammarCompiler:
    """A compiler on llguidance for a loaded tokenizer (None: the model has none, and structured output
    is refused); llguidance reads the tokenizer on the first compile."""
    if tokenizer is None:
        return GrammarCompiler(None)
    return GrammarCompiler(lambda: LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids))


def _require_fast(tokenizer: PreTrainedTokenizerBase | None) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer, and this model has none.")
    if not isinstance(tokenizer, PreTrainedTokenizerFast):  # llguidance reads the Rust tokenizer
        raise ValueError(f"structured output needs a fast tokenizer (tokenizer.json), not {type(tokenizer).__name__}.")
    return tokenizer


def _checked_text(spec: StructuredOutputsParams) -> str:
    try:
        return grammar_text(spec)
    except ValueError as exc:  # JSON text that does not parse, or a schema that is not an object
        raise ValueError(f"structured_outputs.{spec.kind} is invalid: {exc}") from exc


class LLGuidanceChecker:
    """A front end's check of specs, for an engine that compiles them in its own process: llguidance
    validates the grammar without the tokenizer, so the front end neither reads the vocabulary nor
    compiles the grammar the engine will compile (once) for the request. Each spec is validated once,
    on a compile thread; the valid ones are remembered."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, capacity: int = CHECKED_CAPACITY) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._valid: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def check(self, spec: StructuredOutputsParams) -> None:
        _require_fast(self.tokenizer)
        key = spec_key(spec)
        with self._lock:
            if key in self._valid:
                self._valid.move_to_end(key)
                return
        if COMPILE_THREADS.is_current():
            self._validate(spec)
        else:
            COMPILE_THREADS.submit(self._validate, spec).result()
        with self._lock:
            self._valid[key] = None
            if len(self._valid) > self.capacity:
                self._valid.popitem(last=False)

    @staticmethod
    def _validate(spec: StructuredOutputsParams) -> None:
        error = llguidance.LLMatcher.validate_grammar(_checked_text(spec))
        if error:
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {error}")


class LLGuidanceBackend:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: list[int]) -> None:
        """`vocab_size`: the logits' width. llguidance's view of the tokenizer covers it (ids past the
        tokenizer's are never allowed) and lets the grammar end on any of `eos_token_ids`. Building it
        reads the whole vocabulary (about a second for 150k tokens): once per tokenizer."""
        import llguidance.hf  # with transformers: imported only where a tokenizer is read

        fast = _require_fast(tokenizer)
        n_vocab = max(vocab_size, len(fast))
        self.ll_tokenizer = llguidance.hf.from_tokenizer(fast, n_vocab, eos_token_ids or None)
        self._num_words = -(-n_vocab // 32)

    @property
    def num_words(self) -> int:
        return self._num_words

    def compile(self, spec: StructuredOutputsParams) -> LLGuidanceGrammar:
        start = llguidance.LLMatcher(self.ll_tokenizer, _checked_text(spec), log_level=0)  # compiles (GIL released)
        if start.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {start.get_error()}")
        return LLGuidanceGrammar(start)


class LLGuidanceGrammar:
    def __init__(self, start: llguidance.LLMatcher) -> None:
        self.start = start  # never advanced: each request's matcher is a copy (microseconds, not a compile)

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.start.deep_copy())


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        # eos accepted after the grammar had ended: llguidance takes it without counting it, so a
        # rollback must skip it.
        self._num_uncounted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import torch  # the engine's side only: the server checks specs without importing torch

        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the token bitmask must be a contiguous int32 tensor on the CPU")
        words = bitmask[row]  # [num_words]; llguidance checks the byte count against its vocabulary
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token in token_ids:
            ended = self._matcher.is_stopped()
            if not self._matcher.consume_token(token):
                return False
            if ended:
                self._num_uncounted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        uncounted = min(num_tokens, self._num_uncounted)  # the most recent tokens
        self._num_uncounted -= uncounted
        if num_tokens > uncounted:
            self._matcher.rollback(num_tokens - uncounted)

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        valid: int = self._matcher.validate_tokens(token_ids)
        return valid

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()
