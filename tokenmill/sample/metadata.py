"""Per-batch sampling tensors, prepared once per step from the requests' settings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one batch, one row per request.

    Built once per step by `build`. The `no_*` / `all_greedy` flags let the sampler skip whole
    stages: a batch of plain greedy requests costs one argmax. Rows where a setting is off hold
    its neutral value (top_k = vocab_size, top_p = 1, min_p = 0, penalties 1 / 0 / 0).
    """

    temperature: torch.Tensor  # [num_reqs] float32, 1.0 on greedy rows (they never divide by it)
    greedy: torch.Tensor  # [num_reqs] bool
    top_k: torch.Tensor  # [num_reqs] int64, vocab_size where disabled
    top_p: torch.Tensor  # [num_reqs] float32
    min_p: torch.Tensor  # [num_reqs] float32
    # Row -> its own generator, for sampled (non-greedy) rows whose request has a seed.
    generators: dict[int, torch.Generator]
    # Token histories for penalties, padded with vocab_size. Zero width when nobody needs them:
    # the prompt only matters to the repetition penalty, the output to all three.
    prompt_token_ids: torch.Tensor  # [num_reqs, max_prompt_len] int64
    output_token_ids: torch.Tensor  # [num_reqs, max_output_len] int64
    repetition_penalty: torch.Tensor  # [num_reqs] float32
    presence_penalty: torch.Tensor  # [num_reqs] float32
    frequency_penalty: torch.Tensor  # [num_reqs] float32
    # logit_bias as sparse (row, token, value) triples.
    bias_rows: torch.Tensor  # [num_biases] int64
    bias_token_ids: torch.Tensor  # [num_biases] int64
    bias_values: torch.Tensor  # [num_biases] float32
    # (row, token) pairs that would end a request before its min_tokens: masked to -inf.
    min_tokens_rows: torch.Tensor  # [num_masked] int64
    min_tokens_token_ids: torch.Tensor  # [num_masked] int64
    all_greedy: bool
    no_greedy: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_logit_bias: bool
    no_min_tokens: bool
    max_num_logprobs: int | None  # the largest `logprobs` asked for in the batch; None if nobody asked

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """One row per request, in batch order. `generators[i]` is request i's own generator (None to
        use the default one); `output_token_ids[i]` are the tokens it has generated so far."""
        num_reqs = len(params)
        lengths = {len(prompt_token_ids), len(output_token_ids), len(generators)}
        if lengths != {num_reqs}:
            raise ValueError(
                f"SamplingMetadata.build needs one entry per request in every list: got {num_reqs} params, "
                f"{len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs, "
                f"{len(generators)} generators."
            )
        greedy = [p.greedy for p in params]
        # Filters only matter on rows that sample; greedy rows get the neutral value.
        top_k = [p.top_k if not g and 0 < p.top_k < vocab_size else vocab_size for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        no_penalties = not any(p.uses_penalties for p in params)
        uses_repetition = any(p.repetition_penalty != 1.0 for p in params)

        bias_rows, bias_ids, bias_values = _logit_bias_triples(params)
        mask_rows, mask_ids = _min_tokens_pairs(params, output_token_ids, eos_token_ids)
        _check_in_vocab(bias_ids + mask_ids, vocab_size)

        wanted = [p.logprobs for p in params if p.logprobs is not None]

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        def ints(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, device)

        return cls(
            temperature=floats([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            greedy=to_device(greedy, torch.bool, device),
            top_k=ints(top_k),
            top_p=floats(top_p),
            min_p=floats(min_p),
            generators={i: gen for i, (gen, g) in enumerate(zip(generators, greedy)) if gen is not None and not g},
            prompt_token_ids=_pad(prompt_token_ids if uses_repetition else [], num_reqs, vocab_size, device),
            output_token_ids=_pad(output_token_ids if not no_penalties else [], num_reqs, vocab_size, device),
            repetition_penalty=floats([p.repetition_penalty for p in params]),
            presence_penalty=floats([p.presence_penalty for p in params]),
            frequency_penalty=floats([p.frequency_penalty for p in params]),
            bias_rows=ints(bias_rows),
            bias_token_ids=ints(bias_ids),
            bias_values=floats(bias_values),
            min_tokens_rows=ints(mask_rows),
            min_tokens_token_ids=ints(mask_ids),
            all_greedy=all(greedy),
            no_greedy=not any(greedy),
            no_penalties=no_penalties,
            no_top_k=all(k == vocab_size for k in top_k),
            no_top_p=all(p == 1.0 for p in top_p),
            no_min_p=all(p == 0.0 for p in min_p),
            no_logit_bias=not bias_rows,
            no_min_tokens=not mask_rows,
            max_num_logprobs=max(wanted) if wanted else None,
        )


def _logit_bias_triples(params: list[SamplingParams]) -> tuple[list[int], list[int], list[float]]:
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(row)
            token_ids.append(token_id)
            values.append(bias)
    return rows, token_ids, values


def _min_tokens_pairs(
    params: list[SamplingParams], output_token_ids: list[list[int]], eos_token_ids: list[int]
) -> tuple[list[int], list[int]]:
    """Until a request has min_tokens outputs, every token that would stop it is banned. With
    ignore_eos, eos does not stop a request, so it stays allowed. A grammar's request is left alone:
    its grammar decides where it ends (eos may be the only token it allows)."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (p, output) in enumerate(zip(params, output_token_ids)):
        if len(output) >= p.min_tokens or p.structured_outputs is not None:
            continue
        enders = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
        rows.extend([row] * len(enders))
        token_ids.extend(sorted(enders))
    return rows, token_ids


def _check_in_vocab(token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"token ids {sorted(set(bad))} (from logit_bias, stop_token_ids or eos_token_ids) are outside "
            f"the vocabulary (size {vocab_size}); check requests with SamplingParams.check_vocab when they "
            f"arrive."
        )


def _pad(rows: list[list[int]], num_reqs: int, pad: int, device: torch.device) -> torch.Tensor:
    """[num_reqs, max_len] int64, padded with `pad`; zero width when `rows` is empty."""
    if not rows:
        return torch.empty(num_reqs, 0, dtype=torch.int64, device=device)
    width = max(len(r) for r in rows)
    padded = [r + [pad] * (width - len(r)) for r in rows]
    return to_device(padded, torch.int64, device)


def to_device(
    values: Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host list as a tensor on `device`. On CUDA, staged in pinned memory and copied asynchronously:
    `torch.tensor(values, device="cuda")` waits for the stream to drain, i.e. for the step's forward,
    and the step's one host sync is meant to be the sampled ids' `.tolist()`."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
