"""Per-batch sampling tensors, prepared once per step from the requests' settings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [num_reqs] float32 (1.0 on greedy rows, which never use it)
    greedy: torch.Tensor  # [num_reqs] bool
    top_k: torch.Tensor | None  # [num_reqs] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [num_reqs] float32
    min_p: torch.Tensor | None  # [num_reqs] float32
    generators: list[torch.Generator | None]
    # Penalties (None when no request uses them).
    prompt_tokens: torch.Tensor | None  # [num_reqs, max_prompt_len] int64, padded with vocab_size
    output_tokens: torch.Tensor | None  # [num_reqs, max_output_len] int64, padded with vocab_size
    repetition_penalty: torch.Tensor | None  # [num_reqs]
    presence_penalty: torch.Tensor | None  # [num_reqs]
    frequency_penalty: torch.Tensor | None  # [num_reqs]
    # Sparse additions: (row, token, value) for logit_bias and -inf for min_tokens masking.
    bias_rows: torch.Tensor | None
    bias_cols: torch.Tensor | None
    bias_values: torch.Tensor | None
    all_greedy: bool
    max_num_logprobs: int | None

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
        greedy = [p.greedy for p in params]
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
        sampled = [p for p, g in zip(params, greedy) if not g]

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        top_k = top_p = min_p = None
        if any(0 < p.top_k < vocab_size for p in sampled):
            top_k = column([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64)
        if any(p.top_p < 1.0 for p in sampled):
            top_p = column([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in sampled):
            min_p = column([p.min_p for p in params], torch.float32)

        prompt_t = output_t = rep = pres = freq = None
        if any(p.uses_penalties for p in params):
            prompt_t = _pad(prompt_token_ids, vocab_size, device)
            output_t = _pad(output_token_ids, vocab_size, device)
            rep = column([p.repetition_penalty for p in params], torch.float32)
            pres = column([p.presence_penalty for p in params], torch.float32)
            freq = column([p.frequency_penalty for p in params], torch.float32)

        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, (p, out) in enumerate(zip(params, output_token_ids)):
            for tok, bias in (p.logit_bias or {}).items():
                rows.append(i), cols.append(tok), values.append(bias)
            if len(out) < p.min_tokens:  # too early to stop: hide every token that would end it
                enders = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                for tok in enders:
                    rows.append(i), cols.append(tok), values.append(float("-inf"))
        bias = (column(rows, torch.int64), column(cols, torch.int64), column(values, torch.float32)) if rows else (
            None, None, None)

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            greedy=column(greedy, torch.bool),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
            prompt_tokens=prompt_t,
            output_tokens=output_t,
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
            bias_rows=bias[0],
            bias_cols=bias[1],
            bias_values=bias[2],
            all_greedy=all(greedy),
            max_num_logprobs=max(wanted) if wanted else None,
        )


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)
