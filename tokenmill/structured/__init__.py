"""Structured output: a request's tokens constrained to a language (a JSON schema, any JSON object, a
regex, a list of choices, a Lark grammar).

- `backend.py`: the interface a grammar library implements (compile a spec; a matcher per request).
- `llguidance_backend.py`: the one backend, llguidance.
- `compiler.py`: compiles specs with a backend built on first use, caching the recent grammars.
- `compile_threads.py`: the deep-stacked threads every compile and check runs on.
- `limits.py`: the caps on a spec's size and number of choices.
- `waitlist.py`: the engine's requests waiting for their grammar, off the step loop.
- `manager.py`: the model runner's matchers, the step's token bitmask, and advancing the matchers.

The sampler applies the bitmask (tokenmill/sample/bitmask.py)."""
