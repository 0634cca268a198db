"""Token sampling: logit_bias, penalties, min_tokens, greedy / temperature / top-k / top-p / min-p,
per-request seeds, and logprobs.

Per step: `meta = SamplingMetadata.build(...)`, then `Sampler()(logits, meta)`.
"""

from tokenmill.sample.logprobs import compute_topk_logprobs, to_token_logprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "compute_topk_logprobs", "to_token_logprobs"]
