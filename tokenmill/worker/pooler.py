"""Pooling requests' results from a step's hidden states: each pooling request's rows are folded into
its state chunk by chunk (MEAN sums them, CLS keeps the first), and the step that completes its prompt
gives its vector: L2-normalized for an embedding, or through the model's classification head."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.worker.input_batch import RunnerRequestState

# The classification head of a *ForSequenceClassification model: [n, hidden] -> [n, num_labels].
Head = Callable[[torch.Tensor], torch.Tensor]


def pool_step(
    hidden: torch.Tensor,  # [num_tokens, hidden], the final (normed) hidden states of the step
    states: list[RunnerRequestState],  # the step's requests, in batch order
    query_start_loc: list[int],  # [num_reqs + 1]: each request's first row
    head: Head | None,
) -> dict[str, list[float]]:
    """Call before the states' num_computed_tokens count this step. Returns the pooled vectors of the
    pooling requests whose prompt this step completed, by req_id."""
    pooled: dict[str, list[float]] = {}
    for i, state in enumerate(states):
        params = state.pooling_params
        if params is None:
            continue
        start, end = query_start_loc[i], query_start_loc[i + 1]
        rows = hidden[start:end]  # [num_scheduled, hidden]
        if params.pooling_type == "MEAN":
            chunk_sum = rows.float().sum(dim=0)
            state.pooled = chunk_sum if state.pooled is None else state.pooled + chunk_sum
        elif params.pooling_type == "CLS" and state.num_computed_tokens == 0:
            state.pooled = rows[0].float()
        if state.num_computed_tokens + (end - start) < state.num_prompt_tokens:
            continue  # more prompt chunks to come
        if params.pooling_type == "LAST" or state.pooled is None:
            vector = rows[-1].float()
        elif params.pooling_type == "MEAN":
            vector = state.pooled / state.num_prompt_tokens
        else:
            vector = state.pooled
        if params.task == "classify":
            if head is None:
                raise ValueError("this model has no classification head (a *ForSequenceClassification model).")
            vector = head(vector.to(hidden.dtype)[None])[0].float()  # [num_labels]
        elif params.normalize:
            vector = F.normalize(vector, dim=-1)
        pooled[state.req_id] = vector.tolist()
    return pooled
