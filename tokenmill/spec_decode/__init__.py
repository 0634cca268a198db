"""Speculative decoding proposers: the parts that guess the next few tokens of a request cheaply, for
the target model to verify in one forward pass (the verification math is tokenmill.sample.rejection).

`NgramProposer(k, min_n, max_n).propose(token_ids, max_draft)`: prompt lookup over the request's own
tokens (SpeculativeConfig method "ngram").
"""

from tokenmill.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
