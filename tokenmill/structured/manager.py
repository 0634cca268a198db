"""The model runner's grammar state: a matcher per constrained request it holds, the step's token
bitmask, and the matchers' advance over the sampled tokens."""

from __future__ import annotations

import logging

import torch

from tokenmill.sample.bitmask import TokenBitmask
from tokenmill.sample.metadata import to_device
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.backend import GrammarMatcher
from tokenmill.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    """Lives beside the runner's request states and drops a matcher with its state: a finished, aborted
    or preempted request loses it, and a preempted one gets a new matcher when it comes back, which
    accepts the tokens it had output (once: the old matcher is gone)."""

    def __init__(self, grammars: GrammarCompiler, max_num_seqs: int, device: torch.device) -> None:
        self.grammars = grammars
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.matchers: dict[str, GrammarMatcher] = {}
        self._host_bitmask: torch.Tensor | None = None  # [max_num_seqs, num_words] int32, made on first use

    def add_request(self, req_id: str, spec: StructuredOutputsParams, output_token_ids: list[int]) -> None:
        matcher = self.grammars.compile(spec).matcher()  # compiled when the request was added: a cache hit
        if output_token_ids and not matcher.accept_tokens(output_token_ids):
            logger.warning("request %s: its grammar rejects the tokens it output before preemption", req_id)
        self.matchers[req_id] = matcher

    def remove_request(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def bitmask(self, req_ids: list[str]) -> TokenBitmask | None:
        """The allowed tokens of the constrained ones among the step's sampling rows `req_ids`, or None.

        Computed on the host after the forward, before sampling. A worker thread could overlap it with
        the forward, but on a small CPU it would take a core from the GEMMs, for work that is small next
        to the forward's."""
        if not self.matchers:
            return None
        rows = [i for i, req_id in enumerate(req_ids) if req_id in self.matchers]
        if not rows:
            return None
        host = self._host()
        for slot, row in enumerate(rows):
            self.matchers[req_ids[row]].fill_bitmask(host, slot)
        bits = host[: len(rows)]  # [num_constrained, num_words]
        if self.device.type == "cuda":  # pinned: the copy overlaps; the step's sync comes before the next fill
            bits = bits.to(self.device, non_blocking=True)
        index = None if len(rows) == len(req_ids) else to_device(rows, torch.int64, self.device)
        return TokenBitmask(bits, index)

    def accept(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Advance the constrained requests' matchers over the tokens they sampled."""
        for req_id, token in zip(req_ids, token_ids):
            matcher = self.matchers.get(req_id)
            if matcher is not None and not matcher.accept_tokens([token]):
                # Cannot happen for a token the mask allowed; the broken matcher allows only eos next.
                logger.warning("request %s: its grammar rejects the sampled token %d", req_id, token)

    def _host(self) -> torch.Tensor:
        if self._host_bitmask is None:
            shape = (self.max_num_seqs, self.grammars.backend.num_words)
            pinned = self.device.type == "cuda"
            self._host_bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=pinned)
        return self._host_bitmask
