"""llama.cpp (through llama-cpp-python's low-level C API) behind the peer protocol, with continuous batching
of its own: up to `max_num_seqs` sequences share one unified KV cache, and each `llama_decode` call carries
one token for every decoding sequence plus prompt chunks of newly admitted ones (up to n_batch tokens), so
llama.cpp is not held to batch 1. Run with the llamacpp peer's Python on a GGUF converted from the same HF
weights (`request.weights`: f32 for float32, bf16 for bfloat16, q8_0 for int8, q4_0 and q4_1 as named).

Options: max_num_seqs (default 64), n_batch (2048), n_ubatch (512), kv_type ("f32" | "f16" | "bf16";
default f32 for float32 weights, llama.cpp's own default f16 otherwise), flash_attn (-1 auto, 0 off, 1 on),
extra_bufts (default true; false: weights in plain CPU buffers, no AMX or repacked layouts, as llama.cpp's
--no-repack: its AMX buffers crash llama_decode on batches of more than one token on some AMX machines).
"""

from __future__ import annotations

import ctypes
import sys
from collections import deque
from dataclasses import dataclass, field
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

GGML_TYPES = {"f32": 0, "f16": 1, "bf16": 30}


@dataclass
class Slot:
    """One running sequence: its prompt is fed in chunks, then one sampled token per step."""

    index: int  # into the run's prompts
    prompt: list[int]
    output_len: int
    num_fed: int = 0  # tokens already in the KV cache
    output: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.num_fed < len(self.prompt)


class BatchedLlama:
    """A llama.cpp model + context + sampler, fed by a tiny continuous-batching loop."""

    def __init__(
        self,
        lib: Any,
        path: str,
        threads: int,
        max_num_seqs: int,
        n_ctx: int,
        n_batch: int,
        n_ubatch: int,
        kv_type: int,
        flash_attn: int,
        temperature: float,
        seed: int,
        extra_bufts: bool = True,
    ) -> None:
        self.lib = lib
        lib.llama_backend_init()
        self._log_cb = lib.llama_log_callback(lambda level, text, data: None)  # keep a reference
        lib.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        model_params = lib.llama_model_default_params()
        model_params.use_extra_bufts = extra_bufts
        self.model = lib.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_ubatch
        params.n_seq_max, params.kv_unified = max_num_seqs, True
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = kv_type
        params.flash_attn_type = flash_attn
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context (n_ctx too large for memory?)")
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_batch, self.max_num_seqs = n_batch, max_num_seqs
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if temperature > 0:
            lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_temp(temperature))
            lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_dist(seed))
        else:
            lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_greedy())

    def generate(self, prompts: list[PeerPrompt]) -> list[list[int]]:
        """Every prompt to its output_len, EOS ignored; outputs in prompt order."""
        lib, batch = self.lib, self.batch
        lib.llama_memory_clear(self.memory, True)
        waiting = deque(range(len(prompts)))
        free_seqs = list(range(self.max_num_seqs))[::-1]
        running: dict[int, Slot] = {}
        outputs: list[list[int]] = [[] for _ in prompts]
        while waiting or running:
            while waiting and free_seqs:
                i = waiting.popleft()
                running[free_seqs.pop()] = Slot(i, prompts[i].prompt_token_ids, prompts[i].output_len)
            sampled_at: list[tuple[int, int]] = []  # (seq id, batch row whose logits it samples)
            n = 0
            for seq, slot in running.items():  # decoding sequences first: one token each
                if not slot.prefilling:
                    self._put(n, slot.output[-1], slot.num_fed, seq, True)
                    slot.num_fed += 1
                    sampled_at.append((seq, n))
                    n += 1
            for seq, slot in running.items():  # then prompt chunks, within the batch's token budget
                if slot.prefilling and n < self.n_batch:
                    take = min(len(slot.prompt) - slot.num_fed, self.n_batch - n)
                    for k in range(take):
                        last = slot.num_fed + k == len(slot.prompt) - 1
                        self._put(n, slot.prompt[slot.num_fed + k], slot.num_fed + k, seq, last)
                        n += 1
                    slot.num_fed += take
                    if not slot.prefilling:
                        sampled_at.append((seq, n - 1))
            batch.n_tokens = n
            status = lib.llama_decode(self.ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status} (KV cache full? raise n_ctx)")
            for seq, row in sampled_at:
                slot = running[seq]
                slot.output.append(lib.llama_sampler_sample(self.sampler, self.ctx, row))
                if len(slot.output) >= slot.output_len:
                    outputs[slot.index] = slot.output
                    lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    del running[seq]
                    free_seqs.append(seq)
        return outputs

    def _put(self, row: int, token: int, pos: int, seq: int, wants_logits: bool) -> None:
        b = self.batch
        b.token[row], b.pos[row], b.n_seq_id[row] = token, pos, 1
        b.seq_id[row][0] = seq
        b.logits[row] = wants_logits


def drive(request: PeerRequest) -> PeerResult:
    import llama_cpp  # type: ignore[import-not-found]

    if not request.weights:
        raise RuntimeError("the llamacpp peer needs a GGUF file in request.weights")
    temperatures = {p.temperature for run in request.runs for p in run}
    if len(temperatures) > 1:
        raise RuntimeError("the llamacpp driver uses one sampler: give every request the same temperature")
    opts = request.options
    longest = max(len(p.prompt_token_ids) + p.output_len for run in request.runs for p in run)
    max_num_seqs = int(opts.get("max_num_seqs", 64))
    n_ctx = max_num_seqs * (longest + 1)
    kv_name = str(opts.get("kv_type", "f32" if request.dtype == "float32" else "f16"))
    n_batch, n_ubatch = int(opts.get("n_batch", 2048)), int(opts.get("n_ubatch", 512))
    temperature = temperatures.pop() if temperatures else 0.0
    kv_type, flash_attn = GGML_TYPES[kv_name], int(opts.get("flash_attn", -1))
    extra_bufts = bool(opts.get("extra_bufts", True))
    gguf = request.weights

    def load() -> LoadedEngine:
        llama = BatchedLlama(
            llama_cpp,
            gguf,
            request.threads,
            max_num_seqs,
            n_ctx,
            n_batch,
            n_ubatch,
            kv_type,
            flash_attn,
            temperature,
            request.seed,
            extra_bufts,
        )
        return LoadedEngine(
            version=llama_cpp.__version__,
            generate=llama.generate,
            settings=lambda: {
                "gguf": gguf,
                "isa": _isa(llama_cpp.llama_print_system_info()),
                "max_num_seqs": max_num_seqs,
                "n_ctx": n_ctx,
                "n_batch": n_batch,
                "n_ubatch": n_ubatch,
                "kv_type": kv_name,
                "extra_bufts": extra_bufts,
                "threads": request.threads,
            },
            notes=["continuous batching in the driver over llama_decode with one sequence id per request"],
        )

    return time_engine(request, load)


def _isa(system_info: bytes) -> str:
    """The vector extensions llama.cpp's CPU backend was built with, from its system-info line
    ("CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | ...")."""
    text = system_info.decode(errors="replace")
    names = ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_INT8")
    found = [n for n in names if f"{n} = 1" in text]
    return "ggml " + (" ".join(found) or text.strip()[:80])


if __name__ == "__main__":
    sys.exit(serve(drive))
