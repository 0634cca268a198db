"""A smaller model with the target's vocabulary proposes the drafts: its argmax for greedy requests,
a draw from the request's sampling distribution for sampled ones (verified by rejection sampling
against it).

The draft runs on the same engine: the same attention backend, the same block tables (its own KV
tensors, one block for every target block, so the scheduler's allocation serves both) and, on CPU, the
fused decode stack. Each request's draft KV is valid for its first `computed` tokens: a proposal first
feeds the committed tokens past that (the whole prompt the first time; afterwards the last step's
accepted tokens and the target's own token), whose last row gives the first draft, then one decode
step per further draft. The drafts' own KV (positions past the committed tokens) is written in the
request's lookahead slots (the scheduler reserves k of them) and overwritten when those positions
are committed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.fused_decode import FusedDecode
from tokenmill.sample.distribution import filtered_probs, inverse_cdf, row_uniforms
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.proposer import Proposal

# A seeded request's draft draws use their own stream, apart from the target's (see the model runner).
_SEED_STRIDE = 1_000_003
_DRAFT_SALT = 0x5EED_D4AF
_NO_PROBS = torch.empty(0)  # a greedy draft's q: one-hot, nothing to keep


class DraftAttention(Protocol):
    kv_cache: torch.Tensor | None


class DraftLayer(Protocol):
    @property
    def self_attn(self) -> DraftAttention: ...


class DraftLM(Protocol):
    @property
    def layers(self) -> Sequence[DraftLayer]: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DraftModelProposer:
    def __init__(self, model: DraftLM, fused: FusedDecode | None, block_size: int, device: torch.device) -> None:
        self.model = model
        self.fused = fused  # the draft's fused CPU decode stack, or None (layer by layer)
        self.block_size = block_size
        self.device = device
        self.computed: dict[str, int] = {}  # req_id -> tokens whose draft KV is written

    def remove_request(self, req_id: str) -> None:
        self.computed.pop(req_id, None)

    @torch.inference_mode()
    def propose(
        self,
        req_ids: list[str],
        token_ids: list[list[int]],
        block_ids: list[list[int]],
        max_drafts: list[int],
        params: list[SamplingParams],
    ) -> Proposal:
        drafts: list[list[int]] = [[] for _ in req_ids]
        probs: list[list[torch.Tensor]] = [[] for _ in req_ids]
        # A request whose blocks cannot hold its drafts' KV (the scheduler could not reserve the
        # lookahead) proposes fewer, or none.
        counts = [
            min(n, len(blocks) * self.block_size - len(tokens) + 1)
            for tokens, blocks, n in zip(token_ids, block_ids, max_drafts)
        ]
        active = [i for i, n in enumerate(counts) if n > 0]
        if active:
            logits = self._catch_up(
                [req_ids[i] for i in active], [token_ids[i] for i in active], [block_ids[i] for i in active]
            )
            self._pick(logits, active, 0, token_ids, params, drafts, probs)
        for step in range(1, max(counts, default=0)):
            active = [i for i in active if counts[i] > step]
            if not active:
                break
            # Feed draft `step - 1` (at position len(tokens) + step - 1) to get draft `step`.
            positions = [len(token_ids[i]) + step - 1 for i in active]
            logits = self._decode([drafts[i][-1] for i in active], positions, [block_ids[i] for i in active])
            self._pick(logits, active, step, token_ids, params, drafts, probs)
        return Proposal(drafts, [torch.stack(p) if p and p[0].numel() else None for p in probs])

    def _pick(
        self,
        logits: torch.Tensor,  # [len(active), vocab]
        active: list[int],
        step: int,
        token_ids: list[list[int]],
        params: list[SamplingParams],
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Each active request's next draft: the argmax for a greedy request; for a sampled one a draw
        from the request's temperature / top-k / top-p / min-p distribution (sample/distribution.py,
        the pipeline the target's p comes from, so q lies close to p), kept as q for the rejection
        sampler. Seeded requests draw from their seed and the draft's position, so their output depends
        on nothing else."""
        picked = logits.argmax(dim=-1).tolist()
        rows = [row for row, i in enumerate(active) if not params[i].greedy]
        q_rows: list[torch.Tensor] = [_NO_PROBS] * len(active)
        if rows:
            n = len(rows)
            positions = [len(token_ids[active[row]]) + step for row in rows]
            meta = SamplingMetadata.build(
                params=[params[active[row]] for row in rows],
                prompt_token_ids=[[]] * n,  # q is the filtered distribution only: no penalties
                output_token_ids=[[]] * n,
                generators=[self._draft_generator(params[active[row]], pos) for row, pos in zip(rows, positions)],
                eos_token_ids=[],
                vocab_size=logits.shape[1],
                device=self.device,
            )
            index = torch.tensor(rows, dtype=torch.int64, device=self.device)
            q = filtered_probs(logits[index].float(), meta)  # [n, vocab]
            tokens = inverse_cdf(q, row_uniforms(meta, n, self.device)).tolist()
            for row, token, q_row in zip(rows, tokens, q.unbind()):
                picked[row] = token
                q_rows[row] = q_row
        for row, i in enumerate(active):
            drafts[i].append(picked[row])
            probs[i].append(q_rows[row])

    def _draft_generator(self, params: SamplingParams, position: int) -> torch.Generator | None:
        """A seeded request's generator for its draft at `position`, None for an unseeded one."""
        if params.seed is None:
            return None
        generator = torch.Generator(self.device)
        generator.manual_seed((params.seed * _SEED_STRIDE + position + _DRAFT_SALT) % 2**64)
        return generator

    def _catch_up(self, req_ids: list[str], token_ids: list[list[int]], block_ids: list[list[int]]) -> torch.Tensor:
        """Feed each request's committed tokens the draft has not seen; returns the logits of its last
        one, [num_reqs, vocab], which give its first draft."""
        starts = [min(self.computed.get(r, 0), len(t) - 1) for r, t in zip(req_ids, token_ids)]
        inputs: list[int] = []
        positions: list[int] = []
        for tokens, start in zip(token_ids, starts):
            inputs.extend(tokens[start:])
            positions.extend(range(start, len(tokens)))
        query_lens = [len(t) - s for t, s in zip(token_ids, starts)]
        meta = self._metadata(positions, query_lens, [len(t) for t in token_ids], block_ids)
        ids = torch.tensor(inputs, dtype=torch.int64, device=self.device)  # [num_tokens]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        if self.fused is not None and meta.max_query_len <= FusedDecode.MAX_QUERY_LEN:
            hidden = self.fused(ids, pos, meta)
        else:
            hidden = self.model(ids, pos, meta)  # [num_tokens, hidden]
        last_rows = torch.tensor(meta.query_start_loc_cpu[1:], device=self.device) - 1
        for req_id, tokens in zip(req_ids, token_ids):
            self.computed[req_id] = len(tokens)
        return self.model.compute_logits(hidden[last_rows])

    def _decode(self, inputs: list[int], positions: list[int], block_ids: list[list[int]]) -> torch.Tensor:
        """One decode step of the draft; the logits, [num_reqs, vocab]."""
        meta = self._metadata(positions, [1] * len(inputs), [p + 1 for p in positions], block_ids)
        ids = torch.tensor(inputs, dtype=torch.int64, device=self.device)  # [num_reqs]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.fused(ids, pos, meta) if self.fused is not None else self.model(ids, pos, meta)
        return self.model.compute_logits(hidden)

    def _metadata(
        self, positions: list[int], query_lens: list[int], seq_lens: list[int], block_ids: list[list[int]]
    ) -> AttentionMetadata:
        bs = self.block_size
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        req_of_token = [i for i, n in enumerate(query_lens) for _ in range(n)]
        slots = [block_ids[i][p // bs] * bs + p % bs for i, p in zip(req_of_token, positions)]
        width = max(len(b) for b in block_ids)
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(
                [b + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32, device=dev
            ),  # [num_reqs, width]
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
