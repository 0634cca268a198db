"""Specs to compiled grammars, with the backend built on first use and the recent grammars cached."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.backend import Grammar, GrammarBackend

# Compiled grammars kept: clients tend to resend a few schemas, and each grammar holds its lexer's tables.
DEFAULT_CAPACITY = 64


def spec_key(spec: StructuredOutputsParams) -> str:
    """sha256 of the spec's kind and text. A schema's key order is kept: llguidance emits properties in
    the schema's order, so reordered schemas are different grammars."""
    value = getattr(spec, spec.kind)  # True for json_object
    text = value if isinstance(value, str) else json.dumps(value)
    return hashlib.sha256(f"{spec.kind}\0{text}".encode()).hexdigest()


class GrammarCompiler:
    def __init__(self, make_backend: Callable[[], GrammarBackend] | None, capacity: int = DEFAULT_CAPACITY) -> None:
        """`make_backend`: builds the backend (reading the tokenizer) the first time a spec is compiled,
        so engines that never see one never pay for it; None when the model has no tokenizer."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()  # least recently used first
        self.capacity = capacity

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            if self._make_backend is None:
                raise ValueError("structured output needs the model's tokenizer, and this model has none.")
            self._backend = self._make_backend()
        return self._backend

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile (and cache) `spec`: where the engine shares this compiler, its compile is a cache hit."""
        self.compile(spec)

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The grammar for `spec`, compiled or from the cache; ValueError with the backend's message if
        the schema, regex or grammar is invalid."""
        key = spec_key(spec)
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = self.backend.compile(spec)
        self._grammars[key] = grammar
        if len(self._grammars) > self.capacity:
            self._grammars.popitem(last=False)
        return grammar
