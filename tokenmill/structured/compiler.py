"""Specs to compiled grammars, with the backend built on first use and the recent grammars cached.
Compiles run on the compile threads (compile_threads.py), one per spec however many ask at once."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.backend import Grammar, GrammarBackend
from tokenmill.structured.compile_threads import COMPILE_THREADS

# Compiled grammars kept: clients tend to resend a few schemas, and each grammar holds its lexer's tables.
DEFAULT_CAPACITY = 64


def spec_text(spec: StructuredOutputsParams) -> str:
    """The spec's value as text: a string as given, a dict schema or a choice list as JSON."""
    value = getattr(spec, spec.kind)  # True for json_object
    return value if isinstance(value, str) else json.dumps(value)


def spec_key(spec: StructuredOutputsParams) -> str:
    """sha256 of the spec's kind and text. A schema's key order is kept: llguidance emits properties in
    the schema's order, so reordered schemas are different grammars."""
    return hashlib.sha256(f"{spec.kind}\0{spec_text(spec)}".encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCompiler:
    def __init__(self, make_backend: Callable[[], GrammarBackend] | None, capacity: int = DEFAULT_CAPACITY) -> None:
        """`make_backend`: builds the backend (reading the tokenizer) the first time a spec is compiled,
        so engines that never see one never pay for it; None when the model has no tokenizer."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()  # least recently used first
        self._compiling: dict[str, Future[Grammar]] = {}
        self._lock = threading.Lock()  # the step loop reads the cache while a compile thread fills it
        self.capacity = capacity

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                if self._make_backend is None:
                    raise ValueError("structured output needs the model's tokenizer, and this model has none.")
                self._backend = self._make_backend()
            return self._backend

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile (and cache) `spec`: where the engine shares this compiler, its compile is a cache hit."""
        self.compile(spec)

    def cached(self, spec: StructuredOutputsParams) -> Grammar | None:
        """The grammar for `spec` if it is compiled already, else None; never compiles."""
        key = spec_key(spec)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
            return grammar

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The grammar for `spec`, compiled (on a compile thread, waited for) or from the cache;
        ValueError with the backend's message if the schema, regex or grammar is invalid."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        if COMPILE_THREADS.is_current():  # a job waiting on a later job could wait forever
            return self._compile(spec_key(spec), spec)
        return self.compile_async(spec).result()

    def compile_async(self, spec: StructuredOutputsParams) -> Future[Grammar]:
        """The grammar for `spec` on a future: done at once from the cache, else when a compile thread
        has compiled it (a spec already compiling shares that compile)."""
        key = spec_key(spec)
        with self._lock:
            grammar = self._grammars.get(key)
            compiling = self._compiling.get(key)
            if grammar is None and compiling is None:
                compiling = self._compiling[key] = COMPILE_THREADS.submit(self._compile, key, spec)
        if compiling is not None:
            return compiling
        done: Future[Grammar] = Future()
        done.set_result(grammar)  # type: ignore[arg-type]
        return done

    def _compile(self, key: str, spec: StructuredOutputsParams) -> Grammar:
        try:
            grammar = self.backend.compile(spec)
        except BaseException:
            with self._lock:
                self._compiling.pop(key, None)
            raise
        with self._lock:  # cached as it stops compiling: a spec asked for meanwhile finds one or the other
            self._compiling.pop(key, None)
            self._grammars[key] = grammar
            self._grammars.move_to_end(key)
            if len(self._grammars) > self.capacity:
                self._grammars.popitem(last=False)
        return grammar
