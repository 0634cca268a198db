"""CTranslate2 `Generator.generate_batch` behind the peer protocol. Run with the ct2 peer's Python on a
folder converted from the same HF weights (`request.weights`), with `compute_type` = the request's dtype
(float32, bfloat16, or int8 = int8 weights with float32 activations).

`generate_batch` takes one max_length per call and no per-request limit, so requests go in static batches
sorted by output length, each run to its longest request (min_length = max_length, so EOS never ends it
early). Ids past a request's own output_len are not counted. Each batch size in `options["batch_sizes"]`
is timed as its own variant; the comparison reports the best."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
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
    )

DEFAULT_BATCH_SIZES = (16, 32, 64)
COMPUTE_TYPES = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8_float32"}


def load_vocabulary(folder: Path) -> list[str]:
    """The converted model's tokens, indexed by id (CTranslate2 takes prompts as token strings)."""
    if (folder / "vocabulary.json").is_file():
        return list(json.loads((folder / "vocabulary.json").read_text()))
    return (folder / "vocabulary.txt").read_text().split("\n")[:-1]


def drive(request: PeerRequest) -> PeerResult:
    import ctranslate2  # type: ignore[import-not-found]

    if request.dtype not in COMPUTE_TYPES:
        raise RuntimeError(f"the ct2 peer runs {sorted(COMPUTE_TYPES)}, not {request.dtype}")
    if not request.weights:
        raise RuntimeError("the ct2 peer needs a converted CTranslate2 folder in request.weights")
    weights = request.weights
    ctranslate2.set_random_seed(request.seed)
    batch_sizes = [int(b) for b in request.options.get("batch_sizes", DEFAULT_BATCH_SIZES)]

    def load() -> LoadedEngine:
        generator = ctranslate2.Generator(
            weights,
            device="cpu",
            compute_type=COMPUTE_TYPES[request.dtype],
            intra_threads=request.threads,
            inter_threads=1,
        )
        vocab = load_vocabulary(Path(weights))

        def batched(batch_size: int) -> Generate:
            return in_static_batches(partial(generate_batch, generator, vocab), batch_size)

        return LoadedEngine(
            version=ctranslate2.__version__,
            generate=batched(2),
            variants=[(f"batch {b}", batched(b)) for b in batch_sizes],
            settings=lambda: {
                "compute_type": COMPUTE_TYPES[request.dtype],
                "batch_sizes": batch_sizes,
                "intra_threads": request.threads,
            },
            notes=["static batches sorted by output length; ids past a request's output_len are not counted"],
            warmup_prompts=[WARMUP_PROMPT, WARMUP_PROMPT],
        )

    return time_engine(request, load)


def generate_batch(generator: Any, vocab: list[str], prompts: list[PeerPrompt]) -> list[list[int]]:
    """One static batch run to its longest request, EOS ignored (min_length = max_length)."""
    temperatures = {p.temperature for p in prompts}
    if len(temperatures) != 1:
        raise RuntimeError("one static batch needs one temperature")
    temperature = temperatures.pop()
    new = max(p.output_len for p in prompts)
    sampling = (
        {"sampling_topk": 0, "sampling_topp": 1.0, "sampling_temperature": temperature}
        if temperature > 0
        else {"sampling_topk": 1}
    )
    results = generator.generate_batch(
        [[vocab[t] for t in p.prompt_token_ids] for p in prompts],
        max_batch_size=0,
        max_length=new,
        min_length=new,
        include_prompt_in_result=False,
        **sampling,
    )
    return [list(r.sequences_ids[0]) for r in results]


if __name__ == "__main__":
    sys.exit(serve(drive))
