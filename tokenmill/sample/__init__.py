"""Token sampling: logit_bias, penalties, min_tokens, grammar masks, greedy / temperature / top-k /
top-p / min-p, per-request seeds, and logprobs.

Per step: `meta = SamplingMetadata.build(...)`, then `Sampler()(logits, meta)`, with the step's
`TokenBitmask` (from tokenmill.structured) as a third argument when some rows are constrained.
distribution.py defines the distribution each row draws from, once, for the sampler and for
speculative decoding (the draft's q, the target's p in rejection.py).
"""

from tokenmill.sample.logprobs import compute_topk_logprobs, to_token_logprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "compute_topk_logprobs", "to_token_logprobs"]
