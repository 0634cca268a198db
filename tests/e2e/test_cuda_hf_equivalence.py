"""On a CUDA GPU, in bf16: tokenmill's greedy tokens are HF transformers' on the same tiny random weights
(every family), with CUDA graphs and with chunked prefill (eager steps), and its logprobs are as close to
HF's float32 ones as HF's own bf16 are. Skipped without a GPU (bench/scripts/gpu.sh runs it on one).

Two correct bf16 implementations round differently (HF's SDPA and ours), so where the top two logits are
closer than bf16 can tell apart either may be chosen, and free-running continuations part there. So HF
scores tokenmill's own continuation (teacher forcing, in bf16 and in float32): at every step tokenmill's
token must be HF bf16's argmax or within TIE of it, and most steps must match exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (pip install -e '.[gpu]')"),
]

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
TIE = 0.125  # logprobs this close are a tie in bf16 (logits of a few units; bf16 keeps 8 bits)
# Short prompts, and contexts past 256 tokens so decode attention splits the context (attention/triton/decode.py).
PROMPTS = random_prompts(6, 3, 60, seed=11) + random_prompts(3, 300, 420, seed=12)


@torch.inference_mode()
def hf_logprobs(folder: Path, dtype: torch.dtype, sequences: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """HF's log-softmax at each completion position of each (prompt, completion), in one forward pass each:
    [len(completion), vocab] float32 per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    rows = []
    for prompt, completion in sequences:
        ids = torch.tensor([prompt + completion[:-1]], device="cuda")
        logits = model(ids).logits[0, len(prompt) - 1 :].float()  # [len(completion), vocab]
        rows.append(torch.log_softmax(logits, dim=-1).cpu())
    del model
    torch.cuda.empty_cache()
    return rows


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},  # CUDA graphs for the decode steps, the Triton kernels for the prompts
        {"max_num_batched_tokens": 64, "enforce_eager": True},  # prompts in chunks after cached context; no graphs
    ],
    ids=["cuda-graphs", "eager-chunked-prefill"],
)
def test_greedy_bf16_on_cuda_matches_hf(tiny_model: Path, engine_kwargs: dict[str, object]) -> None:
    llm = LLM(
        str(tiny_model),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
        **engine_kwargs,  # type: ignore[arg-type]
    )
    runner = llm.engine.runner
    assert runner.backend.name == "triton"
    assert (runner.cuda_graphs is not None) == ("enforce_eager" not in engine_kwargs)
    completions = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del llm
    sequences = [(p, list(c.token_ids)) for p, c in zip(PROMPTS, completions)]
    hf_bf16 = hf_logprobs(tiny_model, torch.bfloat16, sequences)
    hf_fp32 = hf_logprobs(tiny_model, torch.float32, sequences)
    steps = exact = 0
    ours_err = hf_err = 0.0
    for (_, tokens), completion, bf16, fp32 in zip(sequences, completions, hf_bf16, hf_fp32):
        assert len(tokens) == MAX_NEW
        for step, token in enumerate(tokens):
            best = int(bf16[step].argmax())
            gap = float(bf16[step][best] - bf16[step][token])
            assert gap <= TIE, f"step {step}: ours {token}, HF bf16 {best}, {gap:.3f} apart: no tie"
            exact += token == best
            steps += 1
            ours_err += abs(completion.logprobs[step][token].logprob - float(fp32[step][token]))
            hf_err += abs(float(bf16[step][token]) - float(fp32[step][token]))
    assert exact >= 0.85 * steps, f"only {exact} of {steps} steps chose HF bf16's argmax"
    # As accurate as HF's own bf16 against float32 (a wrong kernel errs by whole units).
    assert ours_err / steps <= 3 * hf_err / steps + 0.02, (ours_err / steps, hf_err / steps)
