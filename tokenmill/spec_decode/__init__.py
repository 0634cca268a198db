"""Speculative decoding proposers: the parts that guess the next few tokens of a request cheaply, for
the target model to verify in one forward pass (worker/spec_verify.py; sample/rejection.py for drafts
drawn from a distribution).

- proposer.py: the Proposer interface the model runner calls, and n-gram prompt lookup (method "ngram",
  ngram.py's NgramProposer: the latest earlier occurrence of the sequence's last n tokens).
- draft_model.py: a smaller model with the target's vocabulary (method "draft_model").
"""

from tokenmill.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
