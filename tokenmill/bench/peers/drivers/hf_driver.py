"""HF transformers `generate` with static batches, behind the peer protocol. Run with the hf peer's Python.

`generate` takes one `max_new_tokens` per call and has no refill, so requests go in static batches of
B (sorted by output length, which favours the peer: less is generated only to be thrown away), each batch
left-padded and run to its longest request (`min_new_tokens` = `max_new_tokens`, so EOS never ends it early).
Ids past a request's own output_len are not counted. Each batch size in `options["batch_sizes"]` is timed
as its own variant; the comparison reports the best."""

from __future__ import annotations

import sys
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the package path for type checkers; at run time the driver's folder is on sys.path
    from tokenmill.bench.peers.drivers.peer_protocol import (
        WARMUP_PROMPT,
        Generate,
        LoadedEngine,
        PeerPrompt,
        PeerRequest,
        PeerResult,
        in_static_batches,
        serve,
        time_engine,
        torch_cpu_capability,
    )
else:
    from peer_protocol import (
        WARMUP_PROMPT,
        Generate,
        LoadedEngine,
        PeerPrompt,
        PeerRequest,
        PeerResult,
        in_static_batches,
        serve,
        time_engine,
        torch_cpu_capability,
    )

DEFAULT_BATCH_SIZES = (8, 16, 32)
PAD_ID = 0


def drive(request: PeerRequest) -> PeerResult:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if request.dtype not in dtypes:
        raise RuntimeError(f"the hf peer runs float32 or bfloat16, not {request.dtype}")
    torch.set_num_threads(request.threads)
    torch.manual_seed(request.seed)
    batch_sizes = [int(b) for b in request.options.get("batch_sizes", DEFAULT_BATCH_SIZES)]

    def load() -> LoadedEngine:
        model = AutoModelForCausalLM.from_pretrained(request.model, dtype=dtypes[request.dtype]).eval()

        def batched(batch_size: int) -> Generate:
            return in_static_batches(partial(generate_batch, model), batch_size)

        return LoadedEngine(
            version=transformers.__version__,
            generate=batched(2),
            variants=[(f"batch {b}", batched(b)) for b in batch_sizes],
            settings=lambda: {
                "dtype": request.dtype,
                "isa": torch_cpu_capability(),
                "batch_sizes": batch_sizes,
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
            },
            notes=["static batches sorted by output length; ids past a request's output_len are not counted"],
            warmup_prompts=[WARMUP_PROMPT, WARMUP_PROMPT],
        )

    return time_engine(request, load)


def generate_batch(model: Any, prompts: list[PeerPrompt]) -> list[list[int]]:
    """One static batch, left-padded, run to its longest request with EOS ignored."""
    import torch

    temperatures = {p.temperature for p in prompts}
    if len(temperatures) != 1:
        raise RuntimeError("one static batch needs one temperature")
    temperature = temperatures.pop()
    width = max(len(p.prompt_token_ids) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)  # [batch, width], left-padded
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [batch, width]
    for row, p in enumerate(prompts):
        ids[row, width - len(p.prompt_token_ids) :] = torch.tensor(p.prompt_token_ids)
        mask[row, width - len(p.prompt_token_ids) :] = 1
    new = max(p.output_len for p in prompts)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=PAD_ID,
            **sampling,
        )
    return [out[row, width:].tolist() for row in range(len(prompts))]


if __name__ == "__main__":
    sys.exit(serve(drive))
