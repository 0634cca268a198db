"""tokenmill itself behind the peer protocol, run with the project's own Python, so that it is measured in
a fresh process exactly as the peers are. Options: any `EngineArgs` field (max_num_seqs, ...)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the package path for type checkers; at run time the driver's folder is on sys.path
    from tokenmill.bench.peers.drivers.peer_protocol import (
        LoadedEngine,
        PeerPrompt,
        PeerRequest,
        PeerResult,
        serve,
        time_engine,
    )
else:
    from peer_protocol import LoadedEngine, PeerPrompt, PeerRequest, PeerResult, serve, time_engine


def drive(request: PeerRequest) -> PeerResult:
    import torch

    import tokenmill
    from tokenmill import LLM, SamplingParams
    from tokenmill.config import EngineArgs

    torch.set_num_threads(request.threads)
    kwargs = {k: v for k, v in request.options.items() if k in EngineArgs.__dataclass_fields__}
    if request.dtype == "int8":
        if "quantization" not in EngineArgs.__dataclass_fields__:
            raise RuntimeError("this tokenmill has no int8 quantization yet")
        kwargs["quantization"] = "int8"
    elif request.dtype in ("q4_0", "q4_1"):  # llama.cpp's formats: int4 in groups of 32, q4_1 with minimums
        kwargs.update(quantization="int4", quantization_group_size=32, quantization_zero_point=request.dtype == "q4_1")
    else:
        kwargs["dtype"] = request.dtype
    kwargs.setdefault("seed", request.seed)

    def params(p: PeerPrompt) -> SamplingParams:
        return SamplingParams(max_tokens=p.output_len, temperature=p.temperature, ignore_eos=True)

    def load() -> LoadedEngine:
        llm = LLM(request.model, **kwargs)

        def generate(prompts: list[PeerPrompt]) -> list[list[int]]:
            outs = llm.generate(
                [{"prompt_token_ids": p.prompt_token_ids} for p in prompts],
                [params(p) for p in prompts],
                use_tqdm=False,
            )
            return [list(o.outputs[0].token_ids) for o in outs]

        def settings() -> dict[str, Any]:
            config = llm.config
            return {
                "dtype": config.model.dtype,
                "isa": _kernel_paths(request.dtype),
                "max_num_seqs": config.scheduler.max_num_seqs,
                "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
                "block_size": config.cache.block_size,
                "attention_backend": llm.engine.runner.backend.name,
                "torch_threads": torch.get_num_threads(),
                "pid": os.getpid(),
            }

        return LoadedEngine(version=tokenmill.__version__, generate=generate, settings=settings)

    return time_engine(request, load)


def _kernel_paths(dtype: str) -> str:
    """Which compiled kernel build ran and the weight path it takes for `dtype` (tokenmill info's words)."""
    from tokenmill.bench.hardware_info import isa_flags, kernel_paths

    paths = kernel_paths(isa_flags())
    weights = {"int8": paths.int8_weights, "float32": paths.float32_weights}.get(dtype, paths.bf16_weights)
    if dtype in ("q4_0", "q4_1"):
        weights = paths.int4_weights
    return f"{paths.build} kernels; {weights}"


if __name__ == "__main__":
    sys.exit(serve(drive))
