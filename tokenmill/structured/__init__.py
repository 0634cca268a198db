"""Structured output: a request's tokens constrained to a language (a JSON schema, any JSON object, a
regex, a list of choices, a Lark grammar).

- `backend.py`: the interface a grammar library implements (compile a spec; a matcher per request).
- `llguidance_backend.py`: the one backend, llguidance.
- `compiler.py`: compiles specs with a backend built on first use, caching the recent grammars.
- `manager.py`: the model runner's matchers, the step's token bitmask, and advancing the matchers.

The sampler applies the bitmask (tokenmill/sample/bitmask.py)."""
