"""HF transformers `generate` with static batches, behind the peer protocol. Run with the hf peer's Python.

`generate` takes one `max_new_tokens` per call and has no refill, so requests go in static batches of
B (sorted by output length, which favours the peer: less is generated only to be thrown away), each batch
left-padded and run to its longest request (`min_new_tokens` = `max_new_tokens`, so EOS never ends it early).
Ids past a request's own output_len are not counted. Each batch size in `options["batch_sizes"]` is timed
as its own variant; the comparison reports the best."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package path for type checkers; at run time the driver's folder is on sys.path
    from tokenmill.bench.peers.drivers.peer_protocol import (
        WARMUP_PROMPT,
        PeerPrompt,
        PeerRequest,
        PeerResult,
        count_run,
        serve,
        static_batches,
        stopwatch,
        torch_cpu_capability,
    )
else:
    from peer_protocol import (
        WARMUP_PROMPT,
        PeerPrompt,
        PeerRequest,
        PeerResult,
        count_run,
        serve,
        static_batches,
        stopwatch,
        torch_cpu_capability,
    )

DEFAULT_BATCH_SIZES = (8, 16, 32)


def drive(request: PeerRequest) -> PeerResult:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if request.dtype not in dtypes:
        raise RuntimeError(f"the hf peer runs float32 or bfloat16, not {request.dtype}")
    torch.set_num_threads(request.threads)
    torch.manual_seed(request.seed)
    model = None
    with stopwatch() as startup:
        model = AutoModelForCausalLM.from_pretrained(request.model, dtype=dtypes[request.dtype]).eval()
    pad_id = 0

    def generate_batch(prompts: list[PeerPrompt]) -> list[list[int]]:
        temperatures = {p.temperature for p in prompts}
        if len(temperatures) != 1:
            raise RuntimeError("one static batch needs one temperature")
        temperature = temperatures.pop()
        width = max(len(p.prompt_token_ids) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width], left-padded
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
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
                pad_token_id=pad_id,
                **sampling,
            )
        return [out[row, width:].tolist() for row in range(len(prompts))]

    def generate(prompts: list[PeerPrompt], batch_size: int) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in prompts]
        for batch in static_batches(prompts, batch_size):
            for i, ids in zip(batch, generate_batch([prompts[i] for i in batch])):
                outputs[i] = ids
        return outputs

    batch_sizes = [int(b) for b in request.options.get("batch_sizes", DEFAULT_BATCH_SIZES)]
    with stopwatch() as warmup:
        generate([WARMUP_PROMPT, WARMUP_PROMPT], 2)
    runs = []
    for prompts in request.runs:
        for batch_size in batch_sizes:
            with stopwatch() as sw:
                outputs = generate(prompts, batch_size)
            runs.append(count_run(prompts, outputs, sw.elapsed, variant=f"batch {batch_size}"))
    return PeerResult(
        engine=request.engine,
        version=transformers.__version__,
        startup_s=startup.elapsed,
        warmup_s=warmup.elapsed,
        runs=runs,
        settings={
            "dtype": request.dtype,
            "isa": torch_cpu_capability(),
            "batch_sizes": batch_sizes,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        notes=["static batches sorted by output length; ids past a request's output_len are not counted"],
    )


if __name__ == "__main__":
    sys.exit(serve(drive))
