"""The runner's per-request state and the flat batch tensors built from it each step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.lora_request import LoRARequest
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.block_table import BlockTables
from tokenmill.worker.staging import Staging

_SEED_STRIDE = 1_000_003


@dataclass
class RunnerRequestState:
    req_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + generated so far
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # KV layer groups 1, 2, ... (sliding-window layers: tokenmill/kv_groups.py): each one's block ids.
    group_block_ids: list[list[int]] = field(default_factory=list)
    generator: torch.Generator | None = None
    # A seeded request's generators for its draft positions (speculative decoding), made on first use.
    draft_generators: list[torch.Generator] = field(default_factory=list)
    # The distributions its proposed drafts were drawn from, [num_drafts, vocab] (a draft model's
    # sampled drafts); None: the drafts are guesses without one.
    draft_probs: torch.Tensor | None = None
    # A pooling request: never samples; `pooled` gathers its pooled rows over its prompt chunks.
    pooling_params: PoolingParams | None = None
    pooled: torch.Tensor | None = None  # [hidden] float32: the MEAN sum so far, or the CLS row
    lora_request: LoRARequest | None = None  # the adapter its rows run (None: the base model)

    def position_seed(self, offset: int, salt: int = 0) -> int:
        """A seeded request's seed for the position `offset` tokens after its last one: its samples
        then depend on nothing else (not the batch, not preemption, not speculation)."""
        seed = self.sampling_params.seed or 0
        # Any Python int is a valid seed: fold it into a generator's 64 bits.
        return (seed * _SEED_STRIDE + len(self.token_ids) + offset + salt) % 2**64

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepBatch:
    """Everything the model forward and the sampler need for one step."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    # Rows of the hidden states whose logits are sampled, one per request that samples this step.
    sample_req_ids: list[str]
    logits_indices: torch.Tensor  # [num_sampled] int64
    # Speculative decoding: per sampling request, the draft tokens it verifies (its last len(drafts) + 1
    # rows are all in logits_indices, in order). None: no request verifies drafts this step.
    draft_token_ids: list[list[int]] | None = None
    # Prompt logprobs: req_id -> (first hidden row, number of rows, first prompt position predicted).
    prompt_logprob_rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def build_step_batch(
    states: list[RunnerRequestState],
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
    drafts: list[list[int]] | None = None,
    pooling: bool = False,
    tables: BlockTables | None = None,
) -> StepBatch:
    """Flatten the scheduled tokens of every request into one batch. `drafts[i]`: the draft tokens request
    i verifies, scheduled after its committed tokens (None: no drafts this step). `pooling`: some request
    pools (it never samples, so the decode batch, where every row samples, cannot hold it). `tables`: the
    runner's block tables, holding every state's row (None: made from the states' block ids)."""
    if tables is None:
        tables = BlockTables.of(device, [(s.req_id, s.block_ids) for s in states])
    if drafts is not None or pooling:
        return _mixed_batch(states, num_scheduled, block_size, tables, drafts)
    if all(n == 1 for n in num_scheduled) and all(s.num_computed_tokens + 1 == len(s.token_ids) for s in states):
        return _decode_batch(states, block_size, tables)
    return _mixed_batch(states, num_scheduled, block_size, tables)


def _mixed_batch(
    states: list[RunnerRequestState],
    num_scheduled: list[int],
    block_size: int,
    tables: BlockTables,
    drafts: list[list[int]] | None = None,
) -> StepBatch:
    """Any step, prompt chunks included: numpy on the host, one copy per tensor."""
    stage = tables.staging.to_device
    num_reqs = len(states)
    query_lens = np.asarray(num_scheduled, dtype=np.int64)
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
    seq_lens = computed + query_lens
    num_tokens = int(qsl[-1])

    # Position of every token: its request's computed count plus its offset within the request's chunk.
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)  # [num_tokens]
    positions = computed[req_of_token] + (np.arange(num_tokens) - qsl[:-1][req_of_token])

    block_tables = tables.host([s.req_id for s in states])  # [num_reqs, max blocks]
    input_ids = np.empty(num_tokens, dtype=np.int64)
    sample_req_ids: list[str] = []
    logits_indices: list[int] = []
    sample_drafts: list[list[int]] = []
    prompt_rows: dict[str, tuple[int, int, int]] = {}
    for i, state in enumerate(states):
        start, end = int(computed[i]), int(seq_lens[i])
        draft = drafts[i] if drafts is not None else []
        tokens = state.token_ids + draft if draft else state.token_ids
        input_ids[qsl[i] : qsl[i + 1]] = tokens[start:end]
        if end == len(tokens) and state.pooling_params is None:
            sample_req_ids.append(state.req_id)
            sample_drafts.append(draft)
            # Every verified position samples: the last committed token's row and each draft's.
            logits_indices.extend(range(int(qsl[i + 1]) - 1 - len(draft), int(qsl[i + 1])))
        if state.sampling_params.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
            # Row for position p predicts prompt token p + 1.
            num_rows = min(end, state.num_prompt_tokens - 1) - start
            prompt_rows[state.req_id] = (int(qsl[i]), num_rows, start + 1)

    slots = block_tables[req_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    meta = AttentionMetadata(
        query_start_loc=stage(qsl.astype(np.int32)),
        seq_lens=stage(seq_lens.astype(np.int32)),
        block_tables=stage(block_tables),
        slot_mapping=stage(slots),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    if states[0].group_block_ids:
        add_group_metadata(meta, states, positions, req_of_token, block_size, tables.staging)
    return StepBatch(
        req_ids=[s.req_id for s in states],
        input_ids=stage(input_ids),
        positions=stage(positions),
        attn_metadata=meta,
        sample_req_ids=sample_req_ids,
        logits_indices=stage(np.asarray(logits_indices, dtype=np.int64)),
        prompt_logprob_rows=prompt_rows,
        draft_token_ids=sample_drafts if drafts is not None else None,
    )


def _decode_batch(states: list[RunnerRequestState], block_size: int, tables: BlockTables) -> StepBatch:
    """The common step: every request feeds its last token and samples the next. Plain lists and one
    tensor each (the block table gathered whole): at decode batch sizes, numpy's per-call cost is most
    of building the small ones."""
    stage, device = tables.staging.to_device, tables.device
    positions = [s.num_computed_tokens for s in states]
    slots = [s.block_ids[p // block_size] * block_size + p % block_size for s, p in zip(states, positions)]
    seq_lens = [p + 1 for p in positions]
    n = len(states)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=stage(np.asarray(seq_lens, dtype=np.int32)),
        block_tables=stage(tables.host([s.req_id for s in states])),  # [n, width]
        slot_mapping=stage(np.asarray(slots, dtype=np.int64)),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    if states[0].group_block_ids:
        add_group_metadata(
            meta, states, np.asarray(positions, dtype=np.int64), np.arange(n), block_size, tables.staging
        )
    req_ids = [s.req_id for s in states]
    return StepBatch(
        req_ids=req_ids,
        input_ids=stage(np.asarray([s.token_ids[-1] for s in states], dtype=np.int64)),
        positions=stage(np.asarray(positions, dtype=np.int64)),
        attn_metadata=meta,
        sample_req_ids=req_ids,
        logits_indices=torch.arange(n, device=device),
    )


def add_group_metadata(
    meta: AttentionMetadata,
    states: list[RunnerRequestState],
    positions: np.ndarray,  # [num_tokens] int64
    req_of_token: np.ndarray,  # [num_tokens]: each token's request (its row in states)
    block_size: int,
    staging: Staging,
) -> None:
    """The metadata of KV layer groups 1, 2, ...: this batch over each group's block tables and slots."""
    for g in range(len(states[0].group_block_ids)):
        tables = np.zeros((len(states), max(len(s.group_block_ids[g]) for s in states)), dtype=np.int32)
        for i, state in enumerate(states):
            tables[i, : len(state.group_block_ids[g])] = state.group_block_ids[g]
        slots = tables[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        meta.group_metadata.append(
            replace(
                meta,
                block_tables=staging.to_device(tables),
                slot_mapping=staging.to_device(slots),
                group_metadata=[],
            )
        )
