"""Caps on what one output constraint may ask the grammar library to build: its text's size and its
number of choices. Within them a compile takes milliseconds; a 50,000-choice list takes seconds and a
deep enough grammar needs more native stack than a compile thread has (compile_threads.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.compiler import spec_text

# Defaults: 64 KiB holds any hand-written schema, regex or grammar (OpenAI caps a schema at 15,000
# characters of names and enum values); 1,000 choices is OpenAI's cap on a schema's enum values.
DEFAULT_MAX_GRAMMAR_BYTES = 64 << 10
DEFAULT_MAX_GRAMMAR_CHOICES = 1000
# The most --max-grammar-bytes may be: the compile threads' stacks hold a grammar this big.
MAX_GRAMMAR_BYTES_CEILING = 256 << 10


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    max_choices: int = DEFAULT_MAX_GRAMMAR_CHOICES

    def __post_init__(self) -> None:
        if not 1 <= self.max_bytes <= MAX_GRAMMAR_BYTES_CEILING:
            raise ValueError(f"--max-grammar-bytes must be between 1 and {MAX_GRAMMAR_BYTES_CEILING}")
        if self.max_choices < 1:
            raise ValueError("--max-grammar-choices must be at least 1")

    def check(self, spec: StructuredOutputsParams) -> None:
        """ValueError saying which cap `spec` is over, and by how much."""
        if spec.choice is not None and len(spec.choice) > self.max_choices:
            raise ValueError(
                f"the constraint lists {len(spec.choice)} choices; this server takes at most "
                f"{self.max_choices} (--max-grammar-choices)."
            )
        try:
            size = len(spec_text(spec).encode("utf-8", "surrogatepass"))
        except RecursionError as exc:  # a dict schema nested beyond any size cap
            raise ValueError("the constraint's schema is nested too deeply.") from exc
        if size > self.max_bytes:
            raise ValueError(
                f"the constraint's {spec.kind} is {size} bytes; this server takes at most {self.max_bytes} "
                "(--max-grammar-bytes)."
            )


DEFAULT_GRAMMAR_LIMITS = GrammarLimits()
