"""A row's numbers never depend on the rows beside it: the packed GEMM (AVX-512 and AVX2) and the AVX-512
paged attention sum in one fixed order whatever the tile shape, so decode (one row), prefill (many) and
speculative verification (1 + k rows) give the same bits, and greedy tokens the same, batched or not.
The AVX2 build (TOKENMILL_CPU_ISA=avx2) runs this file again in a subprocess (the last test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.kernels.avx2_rerun import avx2_rerun_test
from tests.tiny_models import make_tiny_model, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.ops import build, packed_gemm
from tokenmill.quant import Bf16Linear, Int8Linear

needs_gemm = pytest.mark.skipif(not packed_gemm.available(), reason="the packed GEMM could not be built here")
# AVX2 machines prefill through SDPA, not the decode kernel: only the GEMM is compared there.
needs_avx512 = pytest.mark.skipif(
    not (packed_gemm.available() and packed_gemm.isa() == "avx512" and build.cpu_has_avx512_bf16()),
    reason="decode and prefill share one attention kernel only with AVX-512 BF16",
)


@needs_gemm
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("num_rows", [2, 3, 5, 8, 9, 17])
def test_a_rows_gemm_output_is_the_same_alone_and_in_a_batch(kind: str, num_rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=False)
    if kind == "bf16":
        layer: nn.Module = Bf16Linear(linear.weight.to(torch.bfloat16).float(), None)
    else:
        layer = Int8Linear.from_weight(linear.weight, None, kernel="cpu")
    x = torch.randn(num_rows, 576)
    batched = layer(x)  # [num_rows, 960]
    alone = torch.cat([layer(x[i : i + 1]) for i in range(num_rows)])
    assert torch.equal(batched, alone)


@needs_avx512
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_decode_and_prefill_give_the_same_logprobs_bit_for_bit(tmp_path: Path, quantization: str | None) -> None:
    """The logprob of each generated token, decoded one by one, equals its prompt logprob when the whole
    text is computed in one prefill: a bf16 cache and packed weights, the fast paths throughout."""
    model = make_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256, initializer_range=0.05)
    llm = LLM(str(model), dtype="bfloat16", quantization=quantization, num_kv_blocks=64, enable_prefix_caching=False)
    prompt = random_prompts(1, 40, 40, seed=1)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, logprobs=0), use_tqdm=False)[0]
    decoded = out.outputs[0]
    assert decoded.logprobs is not None
    full = llm.generate([prompt + decoded.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[
        0
    ]
    assert full.prompt_logprobs is not None
    prefill = [full.prompt_logprobs[len(prompt) + j] for j in range(len(decoded.token_ids))]
    for j, token in enumerate(decoded.token_ids):
        entry = prefill[j]
        assert entry is not None and entry[token].logprob == decoded.logprobs[j][token].logprob


test_the_avx2_build_passes_these_tests = avx2_rerun_test(__file__)
