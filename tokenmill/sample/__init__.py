"""Token sampling: penalties, filters, seeded draws, and logprobs."""
