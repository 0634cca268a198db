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

    def bitmask(self, req_ids: list[str], drafts: list[list[int]] | None = None) -> TokenBitmask | None:
        """The allowed tokens of the constrained ones among the step's sampling requests `req_ids`, or
        None. With drafts (speculative decoding), request i has len(drafts[i]) + 1 rows: row j is the
        mask after its drafts[:j], walked on its matcher and rolled back (a draft the grammar refuses
        ends the walk: later rows repeat the last mask, and the refused draft is rejected anyway).

        Computed on the host after the forward, before sampling. A worker thread could overlap it with
        the forward, but on a small CPU it would take a core from the GEMMs, for work that is small next
        to the forward's."""
        if not self.matchers:
            return None
        counts = [len(d) + 1 for d in drafts] if drafts is not None else [1] * len(req_ids)
        rows: list[int] = []
        slots: list[tuple[str, list[int]]] = []
        start = 0
        for i, (req_id, count) in enumerate(zip(req_ids, counts)):
            if req_id in self.matchers:
                rows.extend(range(start, start + count))
                slots.append((req_id, drafts[i] if drafts is not None else []))
            start += count
        if not rows:
            return None
        host = self._host(len(rows))
        slot = 0
        for req_id, draft in slots:
            slot = self._fill_walk(self.matchers[req_id], draft, host, slot)
        bits = host[: len(rows)]  # [num_constrained_rows, num_words]
        if self.device.type == "cuda":  # pinned: the copy overlaps; the step's sync comes before the next fill
            bits = bits.to(self.device, non_blocking=True)
        index = None if len(rows) == start else to_device(rows, torch.int64, self.device)
        return TokenBitmask(bits, index)

    @staticmethod
    def _fill_walk(matcher: GrammarMatcher, draft: list[int], host: torch.Tensor, slot: int) -> int:
        """Fill rows slot.. with the masks before each draft token and after the last; the next slot."""
        matcher.fill_bitmask(host, slot)
        # Only the drafts the grammar takes are walked: a refused token would break the matcher.
        walked = matcher.num_valid_prefix(draft) if draft else 0
        for j in range(walked):
            matcher.accept_tokens([draft[j]])
            matcher.fill_bitmask(host, slot + j + 1)
        for j in range(walked + 1, len(draft) + 1):
            host[slot + j] = host[slot + walked]
        if walked:
            matcher.rollback(walked)
        return slot + len(draft) + 1

    def accept(self, req_ids: list[str], token_ids: list[list[int]]) -> None:
        """Advance the constrained requests' matchers over the tokens they emitted this step."""
        for req_id, tokens in zip(req_ids, token_ids):
            matcher = self.matchers.get(req_id)
            if matcher is not None and not matcher.accept_tokens(tokens):
                # Cannot happen for tokens the masks allowed; the broken matcher allows only eos next.
                logger.warning("request %s: its grammar rejects the sampled tokens %s", req_id, tokens)

    def _host(self, num_rows: int) -> torch.Tensor:
        """The host buffer, [>= num_rows, num_words] int32 (pinned on CUDA), grown as needed."""
        if self._host_bitmask is None or self._host_bitmask.shape[0] < num_rows:
            shape = (max(num_rows, self.max_num_seqs), self.grammars.backend.num_words)
            pinned = self.device.type == "cuda"
            self._host_bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=pinned)
        return self._host_bitmask
