"""Runs one scheduled step: keeps per-request state, builds the flat batch, runs the model, samples."""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from tokenmill.attention.pair_layout import cache_row_width
from tokenmill.attention.selector import get_backend
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.parallel_state import pp_world_size
from tokenmill.kv_groups import GroupLimits, KVGroupSpec
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.lora.slots import LoRASlots
from tokenmill.models.fused_decode import FusedDecode, unsupported_reason
from tokenmill.models.llama import LlamaForCausalLM, head_dim_of
from tokenmill.ops import hugepages
from tokenmill.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenmill.sample.logprobs import compute_topk_logprobs, to_token_logprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.draft_model import DraftLM, DraftModelProposer
from tokenmill.spec_decode.proposer import NgramLookup, Proposer
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.manager import StructuredOutputManager
from tokenmill.worker.block_table import BlockTables
from tokenmill.worker.cuda_graph import CudaGraphRunner
from tokenmill.worker.draft_loader import load_draft_model
from tokenmill.worker.input_batch import RunnerRequestState, StepBatch, build_step_batch
from tokenmill.worker.kv_tier_io import KVTierIO, open_kv_tier
from tokenmill.worker.model_interface import CausalLM
from tokenmill.worker.model_loader import load_model
from tokenmill.worker.pending_samples import PLACEHOLDER, HostCopy, PendingSamples, fill_places, hold_places
from tokenmill.worker.pipeline_step import LaunchedStep, finish_pipeline_step, launch_pipeline_step
from tokenmill.worker.pooler import pool_step
from tokenmill.worker.spec_verify import accepted_tokens, verify_metadata
from tokenmill.worker.staging import Staging

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(config: EngineConfig, draft_hf_config: Any = None) -> int:
    """Bytes of one KV block of the target, plus the draft model's when one is given (its cache has a
    block for every target block)."""
    per_block = _model_kv_bytes_per_block(config, config.model.hf_config)
    if draft_hf_config is not None:
        per_block += _model_kv_bytes_per_block(config, draft_hf_config)
    return per_block


def _model_kv_bytes_per_block(config: EngineConfig, hf_config: Any) -> int:
    """One rank's share: its own KV heads (one when the heads are copied to several ranks)."""
    total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    num_kv_heads = max(1, total_kv_heads // config.parallel.tensor_parallel_size)
    itemsize = torch.empty(0, dtype=getattr(torch, config.cache.kv_cache_dtype)).element_size()
    width = cache_row_width(head_dim_of(hf_config), config.cache.kv_cache_dtype)
    # A pipeline stage caches its own layers only: the largest stage's count, so every stage's blocks fit.
    num_layers = max(end - start for start, end in config.parallel.stage_layers(hf_config))
    per_token: int = 2 * num_layers * num_kv_heads * width * itemsize
    return per_token * config.cache.block_size


def warm_up_query_lens(max_query_len: int) -> list[int]:
    """Query lengths 2, 4, 8, ... up to max_query_len: steps with these lengths meet every size of
    Triton prefill tile (attention/triton/prefill.py picks one per power of two of the query length
    times the GQA group, from 16 rows to 128) and the prompt-sized element-wise and sampling launches."""
    lens, n = [], 2
    while n < max_query_len:
        lens.append(n)
        n *= 2
    return [*lens, max(max_query_len, 1)]


def _adapter_id(state: RunnerRequestState) -> int:
    return 0 if state.lora_request is None else state.lora_request.lora_int_id


def _dtype(config: EngineConfig) -> torch.dtype:
    """The activations' dtype (what LoRA updates are computed in)."""
    return cast(torch.dtype, getattr(torch, config.model.dtype))


class ModelRunner:
    def __init__(
        self, config: EngineConfig, folder: Path | None, eos_token_ids: list[int], grammars: GrammarCompiler
    ) -> None:
        self.config = config
        self.folder = folder
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = eos_token_ids
        self.backend = get_backend(config.attention_backend, self.device)
        module = load_model(config.model, folder, self.backend, config.device)
        # An nn.Module; the runner reaches into it only through what CausalLM names.
        self.model = cast(CausalLM, module)
        self.kv_groups = self._assign_kv_groups()
        if config.cache.kv_cache_dtype == "int8":
            self._check_int8_cache()
        # Decode steps run every layer in one C++ call where the model fits it (models/fused_decode.py).
        self.fused_decode, self.fused_decode_off_reason = self._fused_decode_for(module)
        self.sampler = Sampler()
        # Matchers of the requests with structured_outputs, kept and dropped with their states.
        self.structured = StructuredOutputManager(grammars, config.scheduler.max_num_seqs, self.device)
        # The last step's sampling metadata and the request states it was built for, reused while the
        # same requests sample in the same order and nothing in it can change (see _sampling_metadata).
        self._meta: SamplingMetadata | None = None
        self._meta_states: list[RunnerRequestState] = []
        self.states: dict[str, RunnerRequestState] = {}
        # The states' block tables and the step's host-to-device staging, kept from step to step.
        self.block_tables = BlockTables(Staging(self.device))
        # Pipeline stages: steps launched and not yet collected, oldest first (with their token counts).
        self._launched: deque[tuple[LaunchedStep | None, list[int]]] = deque()
        # One stage: steps launched and not yet collected (async scheduling keeps one in flight while
        # it launches the next), each with its output so far and its samples still on their way.
        self._pending: deque[tuple[ModelRunnerOutput, PendingSamples | None]] = deque()
        # The last launched step's sampled ids on the device [num_rows] and each request's row: the
        # next step's inputs where the host holds a placeholder (async scheduling).
        self._last_samples: tuple[torch.Tensor, dict[str, int]] | None = None
        self.pooling_ids: set[str] = set()  # the pooling requests among the states
        # A *ForSequenceClassification model's head, for pooling requests that classify.
        self.classifier_head = getattr(module, "score", None)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_tier: KVTierIO | None = None  # the second KV tier's transfers (open_kv_tier)
        # Speculative decoding: proposes each sampling request's drafts for the next step.
        self.draft: CausalLM | None = None
        self.draft_config: ModelConfig | None = None
        self.proposer: Proposer | None = self._make_proposer()
        self.cuda_graphs: CudaGraphRunner | None = None  # set by capture_cuda_graphs
        self.cuda_graph_capture_s: float | None = None
        # LoRA adapters (--enable-lora): their slots in every adapted layer; None: no adapters served.
        self.loras: LoRASlots | None = None
        if config.lora is not None:
            hf_config, dtype = config.model.hf_config, _dtype(config)
            self.loras = LoRASlots(module, config.lora, hf_config, dtype, self.device)
            if self.fused_decode is not None:
                self.fused_decode.bind_loras(self.loras.layers)

    def _make_proposer(self) -> Proposer | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramLookup(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        module, self.draft_config = load_draft_model(self.config, self.backend)
        self.draft = cast(CausalLM, module)
        fused, _ = self._fused_decode_for(module)
        return DraftModelProposer(cast(DraftLM, module), fused, self.block_size, self.device)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV block: the target's cache, and the draft model's beside it."""
        draft_hf = self.draft_config.hf_config if self.draft_config is not None else None
        return kv_cache_bytes_per_block(self.config, draft_hf)

    def _assign_kv_groups(self) -> KVGroupSpec:
        """The KV layer groups of the model's layers (by their sliding windows); each window layer is told
        its group, whose block tables it reads (tokenmill/kv_groups.py)."""
        attns = [layer.self_attn for layer in self.model.layers]
        spec = KVGroupSpec.of_layers([getattr(attn, "sliding_window", None) for attn in attns])
        for attn, group in zip(attns, spec.layer_groups):
            if group:
                attn.kv_group = group
        return spec

    def kv_cache_bytes_per_group_block(self) -> list[int]:
        """Bytes of one block of each KV layer group (the draft model's layers are in group 0)."""
        target = _model_kv_bytes_per_block(self.config, self.config.model.hf_config)
        counts = self.kv_groups.layer_counts()
        per_group = [target * n // sum(counts) for n in counts]
        per_group[0] += self.kv_cache_bytes_per_block() - target
        return per_group

    def group_pool_blocks(self, num_blocks: int) -> list[int]:
        """Each KV layer group's blocks when group 0 has `num_blocks` (see KVGroupSpec.pool_blocks)."""
        sched = self.config.scheduler
        limits = GroupLimits(self.block_size, sched.max_num_seqs, sched.max_num_batched_tokens)
        return self.kv_groups.pool_blocks(num_blocks, self.config.cache.num_kv_blocks is None, limits)

    def _check_int8_cache(self) -> None:
        """Only the AVX-512 BF16 attention kernel reads an int8 cache: refuse it up front elsewhere."""
        attn = self.model.layers[0].self_attn
        serves = getattr(self.backend, "serves_int8_cache", None)
        if serves is None or not serves(self.block_size, attn.num_kv_heads, attn.head_dim):
            raise ValueError(
                "kv_cache_dtype 'int8' needs the 'cpu' attention backend's AVX-512 BF16 kernel (a CPU with "
                f"avx512_bf16), block_size 16 and head_dim 32, 64 or 128 (here {self.block_size} and "
                f"{attn.head_dim}, backend {self.backend.name}); use 'auto'."
            )

    def _fused_decode_for(self, module: nn.Module) -> tuple[FusedDecode | None, str | None]:
        """Decode steps run every layer in one C++ call (models/fused_decode.py) unless enforce_eager
        or the model (the target or a draft) does not fit it: (the stack, None) or (None, why not)."""
        if self.config.enforce_eager:
            return None, "enforce_eager"
        if pp_world_size() > 1:
            return None, "pipeline parallel (each stage runs its layers eagerly)"
        if not isinstance(module, LlamaForCausalLM):
            return None, f"{type(module).__name__} has no fused decode stack"
        reason = unsupported_reason(module) if self.device.type == "cpu" else "not on CPU"
        return (FusedDecode(module), None) if reason is None else (None, reason)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One [2, num_blocks, block_size, Hkv, D] tensor per layer (D + 4 columns in int8: the scales),
        bound to its attention module (the backend decides the order within a block: see
        attention/pair_layout.py). Zeroed (on CPU by the kernel, a page at its first touch: ops/hugepages.py):
        padded context slots are masked, but must never hold NaN (0 * NaN = NaN)."""
        dtype = getattr(torch, self.config.cache.kv_cache_dtype)
        self.kv_caches = []
        self.cuda_graphs = None  # captured graphs read the old cache in place
        draft_layers = self.draft.layers if self.draft is not None else []
        pools = self.group_pool_blocks(num_blocks)
        groups = [*self.kv_groups.layer_groups, *[0] * len(draft_layers)]
        for layer, group in zip([*self.model.layers, *draft_layers], groups):
            attn = layer.self_attn
            width = cache_row_width(attn.head_dim, self.config.cache.kv_cache_dtype)
            shape = (2, pools[group], self.block_size, attn.num_kv_heads, width)
            if self.device.type == "cpu":  # a step reads blocks anywhere in the pool: fewer TLB misses
                cache = hugepages.zeros(shape, dtype)
            else:
                cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.kv_cache = cache
            self.kv_caches.append(cache)

    def open_kv_tier(self, stats: KVTierStats) -> KVTierIO:
        """Open the second KV tier (--kv-offloading-size) over the allocated cache."""
        if not self.kv_caches:
            raise RuntimeError("allocate the KV cache before opening its second tier")
        self.kv_tier = open_kv_tier(self.config, self.folder, self.kv_caches, stats)
        return self.kv_tier

    def capture_cuda_graphs(self) -> None:
        """Once the KV cache is allocated, on CUDA: compile every kernel variant a step can need
        (warm_up), then capture the decode CUDA graphs (worker/cuda_graph.py), which read the cache
        where it is now. The graphs are skipped with enforce_eager or an attention backend that cannot
        be graphed; every step then runs eagerly."""
        if self.device.type == "cuda" and pp_world_size() == 1:  # stages run their own layers only
            self.warm_up()
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.supports_cuda_graphs:
            return
        if pp_world_size() > 1:
            logger.info("no CUDA graphs: pipeline stages run their layers eagerly")
            return
        attns = [layer.self_attn for layer in self.model.layers]
        if any(getattr(a, "sliding_window", None) or getattr(a, "logit_softcap", None) for a in attns):
            logger.info("no CUDA graphs: sliding-window and soft-capped attention run in PyTorch, eagerly")
            return
        if not self.kv_caches:
            raise RuntimeError("allocate the KV cache before capturing CUDA graphs: they read it in place")
        graphs = CudaGraphRunner(
            self.model,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_model_len=self.config.model.max_model_len,
            block_size=self.block_size,
            hidden_size=self.config.model.hf_config.hidden_size,
            dtype=getattr(torch, self.config.model.dtype),
            device=self.device,
        )
        stats = graphs.capture()  # logs the batch sizes, the seconds and the memory it took
        self.cuda_graphs = graphs
        self.cuda_graph_capture_s = stats.seconds

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One step per query length of warm_up_query_lens, each behind a decode row, on dummy tokens
        (sampled with top-k and top-p): the Triton kernels compile for every tile size, decode and
        sampling variant here, not inside the first requests' steps. Every token's k/v goes to block
        0, which any request that gets it writes over before reading."""
        if not self.kv_caches:
            raise RuntimeError("allocate the KV cache before warming up: the steps write into it")
        sched = self.config.scheduler
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        budget = min(sched.max_num_batched_tokens, sched.max_model_len) - 1
        for n in warm_up_query_lens(budget):
            lens = [1, n]  # a decode row in front, as the scheduler orders a mixed step
            states = [
                RunnerRequestState(
                    req_id=f"warm-up-{i}",
                    num_prompt_tokens=max(n, 2),
                    token_ids=[0] * max(n, 2),
                    sampling_params=params,
                    block_ids=[0] * -(-max(n, 2) // self.block_size),
                    num_computed_tokens=max(n, 2) - length,
                    group_block_ids=[[0] * -(-max(n, 2) // self.block_size)] * (self.kv_groups.num_groups - 1),
                )
                for i, length in enumerate(lens)
            ]
            batch = build_step_batch(states, lens, self.block_size, self.device)
            hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)  # [n + 1, hidden]
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [2, vocab]
            self.sampler(logits, self._dummy_sampling_metadata(params, states))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _dummy_sampling_metadata(self, params: SamplingParams, states: list[RunnerRequestState]) -> SamplingMetadata:
        return SamplingMetadata.build(
            params=[params] * len(states),
            prompt_token_ids=[s.token_ids for s in states],
            output_token_ids=[[] for _ in states],
            generators=[None] * len(states),
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            device=self.device,
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step the scheduler can hand out, on dummy tokens: max_num_batched_tokens tokens
        over up to max_num_seqs prompts, each then sampled with top-k and top-p (the sampler's costliest
        path). Every token's k/v goes to block 0 of a one-block scratch cache, freed afterwards, so the
        step's memory is the weights' plus its activations: the caller measures the peak around it."""
        sched = self.config.scheduler
        num_seqs = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        num_tokens = min(sched.max_num_batched_tokens, num_seqs * sched.max_model_len)
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        states = [
            RunnerRequestState(
                req_id=f"profile-{i}",
                num_prompt_tokens=n,
                token_ids=[0] * n,
                sampling_params=params,
                block_ids=[0] * -(-n // self.block_size),
                num_computed_tokens=0,
                group_block_ids=[[0] * -(-n // self.block_size)] * (self.kv_groups.num_groups - 1),
            )
            for i, n in enumerate(lens)
        ]
        self.allocate_kv_cache(1)
        try:
            batch = build_step_batch(states, lens, self.block_size, self.device)
            hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)  # [num_tokens, hidden]
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_seqs, vocab]
            self.sampler(logits, self._dummy_sampling_metadata(params, states))
        finally:
            for layer in self.model.layers:
                layer.self_attn.kv_cache = None
            self.kv_caches = []

    # ------------------------------------------------------------------ state updates
    def _update_states(self, sched: SchedulerOutput) -> list[RunnerRequestState]:
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
            self.block_tables.remove(req_id)
            self.pooling_ids.discard(req_id)
            self.structured.remove_request(req_id)
            if self.proposer is not None:
                self.proposer.remove_request(req_id)
        for new in sched.new_requests:
            params = new.sampling_params
            if params.structured_outputs is not None:
                self.structured.add_request(new.req_id, params.structured_outputs, new.output_token_ids)
            self.states[new.req_id] = RunnerRequestState(
                req_id=new.req_id,
                num_prompt_tokens=len(new.prompt_token_ids),
                token_ids=new.prompt_token_ids + new.output_token_ids,
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                group_block_ids=[list(ids) for ids in new.group_block_ids],
                generator=torch.Generator(self.device) if params.seed is not None else None,
                pooling_params=new.pooling_params,
                lora_request=new.lora_request,
            )
            self.block_tables.add(new.req_id, new.block_ids)
            if new.pooling_params is not None:
                self.pooling_ids.add(new.req_id)
        for cached in sched.cached_requests:
            state = self.states[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            self.block_tables.extend(cached.req_id, cached.new_block_ids)
            if cached.new_group_block_ids:  # window layers' KV groups (tokenmill/kv_groups.py)
                for ids, new_ids in zip(state.group_block_ids, cached.new_group_block_ids):
                    ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        return [self.states[req_id] for req_id in sched.num_scheduled_tokens]

    # ------------------------------------------------------------------ one step
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step, its output on the host."""
        self.launch(sched)
        return self.collect()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> None:
        """Start a step; `collect` takes the oldest launched step's output. One stage: the forward and the
        sampling are queued on the device and the sampled ids start their way to the host; a step
        launched before the last is collected reads the tokens it needs from the last one's samples on
        the device. Pipeline stages: this rank's layers on the step's tokens (the last stage samples);
        steps in flight together hold other requests (the engine keeps them disjoint)."""
        if self.kv_tier is not None and sched.has_kv_transfers:
            self.kv_tier.transfer(sched)  # before the forward: it writes over evicted blocks, reads loaded ones
        states = self._update_states(sched)
        if self.loras is not None and any(s.lora_request is not None for s in states):
            states.sort(key=_adapter_id)  # each adapter's rows one run (models/layers/lora.py)
        num_scheduled = [sched.num_scheduled_tokens[s.req_id] for s in states]
        pooling = bool(self.pooling_ids) and not self.pooling_ids.isdisjoint(sched.num_scheduled_tokens)
        self.block_tables.staging.begin_step()
        if pp_world_size() > 1:  # this rank runs one stage's layers (worker/pipeline_step.py)
            self._launch_stage(states, num_scheduled, pooling)
            return
        if not states:
            self._pending.append((ModelRunnerOutput(sampled_token_ids={}), None))
            return
        spec = sched.scheduled_spec_tokens
        drafts = [spec.get(s.req_id, []) for s in states] if spec else None
        batch = build_step_batch(
            states, num_scheduled, self.block_size, self.device, drafts, pooling, self.block_tables
        )
        self._fill_placeholders(batch, states)
        if self.loras is None:
            self._pending.append(self._run(batch, states, num_scheduled, spec, pooling))
            return
        adapted = self.loras.begin_step([s.lora_request for s in states], num_scheduled)
        try:  # the LM head's updates need the step's adapters too: they end after sampling
            self._pending.append(self._run(batch, states, num_scheduled, spec, pooling, adapted))
        finally:
            self.loras.end_step()

    def _fill_placeholders(self, batch: StepBatch, states: list[RunnerRequestState]) -> None:
        """Rows whose input token the last launched step sampled and the host does not know yet (async
        scheduling): each is its request's one scheduled token, copied from those samples on the device."""
        if self._last_samples is None:
            return
        sampled, rows = self._last_samples
        self._last_samples = None  # this step's own samples (if any) come next
        qsl = batch.attn_metadata.query_start_loc_cpu
        dst: list[int] = []
        src: list[int] = []
        for i, state in enumerate(states):
            if state.token_ids[-1] == PLACEHOLDER:
                dst.append(qsl[i + 1] - 1)  # the row's last (and only) token
                src.append(rows[state.req_id])
        if dst:
            stage = self.block_tables.staging.to_device
            batch.input_ids[stage(np.asarray(dst, dtype=np.int64))] = sampled[stage(np.asarray(src, dtype=np.int64))]

    def _launch_stage(self, states: list[RunnerRequestState], num_scheduled: list[int], pooling: bool) -> None:
        step = None
        if states:
            model, size, tables = self.model, self.block_size, self.block_tables
            step = launch_pipeline_step(model, states, num_scheduled, size, tables, pooling, self.outputs)
        self._launched.append((step, num_scheduled))

    @torch.inference_mode()
    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest launched step, on every rank: the host waits for its samples only."""
        if pp_world_size() == 1:
            output, pending = self._pending.popleft()
            if pending is not None:
                self._emit(pending, output)
            return output
        step, num_scheduled = self._launched.popleft()
        if step is None:
            return ModelRunnerOutput(sampled_token_ids={})
        output = finish_pipeline_step(step)
        self._advance(step.states, num_scheduled, {}, output)
        return output

    def _run(
        self,
        batch: StepBatch,
        states: list[RunnerRequestState],
        num_scheduled: list[int],
        spec: dict[str, list[int]],
        pooling: bool,
        adapted: bool = False,
    ) -> tuple[ModelRunnerOutput, PendingSamples | None]:
        """The step's forward, then what it yields: pooled rows, prompt logprobs, sampled tokens (on their
        way to the host unless drafts are verified or proposed: those need them now), drafts."""
        hidden = self._forward(batch, adapted)  # [num_tokens, hidden]
        output, pending = self._outputs(hidden, batch, states, pooling)
        if pending is not None and self.proposer is not None:
            self._emit(pending, output)
            pending = None
        self._advance(states, num_scheduled, spec, output)
        if self.proposer is not None and batch.sample_req_ids:
            self._propose(len(states), batch.sample_req_ids, output)
        return output, pending

    def outputs(
        self, hidden: torch.Tensor, batch: StepBatch, states: list[RunnerRequestState], pooling: bool
    ) -> ModelRunnerOutput:
        """What the final hidden states of `batch` ([num_tokens, hidden]) yield, all on the host: pooled
        rows, prompt logprobs, sampled tokens (appended to their states)."""
        output, pending = self._outputs(hidden, batch, states, pooling)
        if pending is not None:
            self._emit(pending, output)
        return output

    def _outputs(
        self, hidden: torch.Tensor, batch: StepBatch, states: list[RunnerRequestState], pooling: bool
    ) -> tuple[ModelRunnerOutput, PendingSamples | None]:
        output = ModelRunnerOutput(sampled_token_ids={})
        if pooling:
            qsl = batch.attn_metadata.query_start_loc_cpu
            output.pooled = pool_step(hidden, states, qsl, self.classifier_head)
        if batch.prompt_logprob_rows:
            output.prompt_logprobs = self._prompt_logprobs(hidden, batch)
        pending = self._sample(hidden, batch, output) if batch.sample_req_ids else None
        return output, pending

    def _advance(
        self,
        states: list[RunnerRequestState],
        num_scheduled: list[int],
        spec: dict[str, list[int]],
        output: ModelRunnerOutput,
    ) -> None:
        """Count the step's computed tokens (rejected drafts are computed again)."""
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
            num_drafts = len(spec.get(state.req_id, ())) if spec else 0
            if num_drafts:  # rejected drafts are computed again: the scheduler rolls back the same way
                state.num_computed_tokens -= num_drafts + 1 - len(output.sampled_token_ids[state.req_id])

    def _forward(self, batch: StepBatch, adapted: bool = False) -> torch.Tensor:
        """A decode step that fits a captured graph replays it (its output is a view, valid until the
        graph's next replay); on CPU a step whose requests have at most FusedDecode.MAX_QUERY_LEN query
        tokens each (decode rows, verification of drafts) runs the fused C++ stack; every other step
        runs eagerly. `adapted`: some rows run LoRA adapters (never in a graph: it holds no updates; not
        in the C++ stack where one adapts the embedding: the stack looks tokens up itself)."""
        if not adapted and self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.run(batch)
        meta = batch.attn_metadata
        embedding_adapted = adapted and self.loras is not None and self.loras.heads.adapts_embedding()
        if self.fused_decode is not None and meta.max_query_len <= FusedDecode.MAX_QUERY_LEN and not embedding_adapted:
            lora_runs = self.loras.context.runs_tensor if adapted and self.loras is not None else None
            return self.fused_decode(batch.input_ids, batch.positions, meta, lora_runs)
        return self.model(batch.input_ids, batch.positions, batch.attn_metadata)

    def _sample(self, hidden: torch.Tensor, batch: StepBatch, output: ModelRunnerOutput) -> PendingSamples | None:
        """Every forward path (a CUDA graph, the fused C++ decode stack, layer by layer) ends at the hidden
        states: the LM head, a grammar's mask and sampling all run here, for every kind of step. The
        sampled rows start their way to the host (`_emit` takes them). A step that verifies drafts
        samples a row per verified position (worker/spec_verify.py) and emits its tokens at once."""
        # Every row samples (a decode step): the rows are the logits' rows already, in order.
        every_row = hidden.shape[0] == batch.logits_indices.numel()
        rows = hidden if every_row else hidden[batch.logits_indices]
        logits = self._logits(rows, None if every_row else batch.logits_indices)  # [num_sample_rows, vocab]
        states = [self.states[r] for r in batch.sample_req_ids]
        drafts = batch.draft_token_ids
        if drafts is None:
            for state in states:
                if state.generator is not None:
                    state.generator.manual_seed(state.position_seed(0))
            meta = self._sampling_metadata(states)
        else:
            meta = verify_metadata(
                states, drafts, self._row_generator, self.eos_token_ids, self.vocab_size, self.device
            )
        bitmask = self.structured.bitmask(batch.sample_req_ids, drafts)
        result = self.sampler(logits, meta, bitmask)
        if drafts is None:
            sampled = result.sampled_token_ids  # [num_rows] int64
            tensors = [sampled]
            if result.topk_token_ids is not None and result.topk_logprobs is not None:
                assert result.sampled_ranks is not None
                tensors += [result.topk_token_ids, result.topk_logprobs, result.sampled_ranks]
            row_of = {s.req_id: i for i, s in enumerate(states)}
            self._last_samples = (sampled, row_of)
            return PendingSamples(states, hold_places(states), HostCopy(tensors), bitmask is not None, row_of)
        emitted = accepted_tokens(result.sampled_token_ids.tolist(), states, drafts, logits, meta, bitmask)
        for state, tokens in zip(states, emitted):
            state.token_ids.extend(tokens)
            output.sampled_token_ids[state.req_id] = tokens
        if bitmask is not None:
            self.structured.accept(batch.sample_req_ids, emitted)
        if result.topk_token_ids is not None:
            self._verified_logprobs(logits, states, drafts, emitted, output)
        return None

    def _emit(self, pending: PendingSamples, output: ModelRunnerOutput) -> None:
        """A step's samples on the host (the step's one wait for the device): its tokens replace their
        placeholders, grammars take them, and the logprobs asked for are read."""
        host = pending.copy.wait()
        tokens = host[0].tolist()
        fill_places(pending, tokens)
        if self._last_samples is not None and self._last_samples[1] is pending.rows:
            self._last_samples = None  # no step launched since: the next one finds every token on the host
        states = pending.states
        for state, token in zip(states, tokens):
            output.sampled_token_ids[state.req_id] = [token]
        if pending.constrained:
            self.structured.accept(pending.req_ids, [[token] for token in tokens])
        lp_rows = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
        if len(host) == 1 or not lp_rows:
            return
        entries = to_token_logprobs(
            host[1][lp_rows],
            host[2][lp_rows],
            host[3][lp_rows],
            num_logprobs=[states[i].sampling_params.logprobs or 0 for i in lp_rows],
        )
        for i, entry in zip(lp_rows, entries):
            output.logprobs[states[i].req_id] = [entry]

    def _verified_logprobs(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]
        states: list[RunnerRequestState],
        drafts: list[list[int]],
        emitted: list[list[int]],
        output: ModelRunnerOutput,
    ) -> None:
        """Logprobs of each emitted token at its own row (a rejection sampler's token need not be the
        row's sample, so the sampler's are not reused)."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[RunnerRequestState] = []
        start = 0
        for state, draft, tokens in zip(states, drafts, emitted):
            if state.sampling_params.logprobs is not None:
                rows.extend(range(start, start + len(tokens)))
                targets.extend(tokens)
                owners.extend([state] * len(tokens))
            start += len(draft) + 1
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        raw = logits[index].to(torch.float32).log_softmax(dim=-1)  # [len(rows), vocab]
        wanted = [s.sampling_params.logprobs or 0 for s in owners]
        target_ids = torch.tensor(targets, dtype=torch.int64, device=self.device)
        ids, values, ranks = compute_topk_logprobs(raw, target_ids, max(wanted))
        for state, entry in zip(owners, to_token_logprobs(ids, values, ranks, num_logprobs=wanted)):
            output.logprobs.setdefault(state.req_id, []).append(entry)

    def _row_generator(self, state: RunnerRequestState, j: int) -> torch.Generator | None:
        """A seeded request's generator for its j-th verified position, seeded for that position."""
        if state.generator is None:
            return None
        if j == 0:
            generator = state.generator
        else:
            while len(state.draft_generators) < j:
                state.draft_generators.append(torch.Generator(self.device))
            generator = state.draft_generators[j - 1]
        generator.manual_seed(state.position_seed(j))
        return generator

    def _propose(self, num_step_reqs: int, req_ids: list[str], output: ModelRunnerOutput) -> None:
        """Draft tokens for the next step of the requests that sampled; none above disable_by_batch_size
        running requests. A constrained request's drafts are checked by its grammar's masks at every
        verified position (StructuredOutputManager.bitmask)."""
        spec = self.config.speculative
        if self.proposer is None or spec is None or num_step_reqs > spec.disable_by_batch_size:
            return
        max_model_len = self.config.model.max_model_len
        chosen: list[RunnerRequestState] = []
        max_drafts: list[int] = []
        for req_id in req_ids:
            state = self.states[req_id]
            max_tokens = state.sampling_params.max_tokens or 0
            # The step that verifies k drafts emits up to k + 1 tokens: never past max_tokens or the context.
            room = min(max_tokens - len(state.output_token_ids) - 1, max_model_len - len(state.token_ids))
            if room > 0:
                chosen.append(state)
                max_drafts.append(min(room, spec.num_speculative_tokens))
        if not chosen:
            return
        proposal = self.proposer.propose(
            [s.req_id for s in chosen],
            [s.token_ids for s in chosen],
            [s.block_ids for s in chosen],
            max_drafts,
            [s.sampling_params for s in chosen],
        )
        for state, draft, probs in zip(chosen, proposal.drafts, proposal.probs):
            state.draft_probs = probs  # what the verifier weighs these drafts against next step
            if draft:
                output.spec_token_ids[state.req_id] = draft

    def _sampling_metadata(self, states: list[RunnerRequestState]) -> SamplingMetadata:
        """The step's sampling tensors. A decode batch of the same requests in the same order reuses
        the last step's: only penalties (the outputs so far) and a min_tokens mask (the output count)
        change from step to step, and a mask, once empty, stays empty. Seeded rows' generators are
        the same objects, reseeded in place each step."""
        meta = self._meta
        if (
            meta is not None
            and meta.no_penalties
            and meta.no_min_tokens
            and len(states) == len(self._meta_states)
            and all(a is b for a, b in zip(states, self._meta_states))
        ):
            return meta
        meta = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            generators=[s.generator for s in states],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        self._meta, self._meta_states = meta, states
        return meta

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The model's logits of `hidden`, the step's rows `rows` (None: all of them, in order): their
        adapters' LM head updates included."""
        if self.loras is not None:
            self.loras.context.select_logit_rows(rows)
        return self.model.compute_logits(hidden)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: StepBatch) -> dict[str, list[TokenLogprobs | None]]:
        out: dict[str, list[TokenLogprobs | None]] = {}
        for req_id, (row, num_rows, first_target) in batch.prompt_logprob_rows.items():
            state = self.states[req_id]
            k = state.sampling_params.prompt_logprobs or 0
            index = torch.arange(row, row + num_rows)
            logprobs = torch.log_softmax(self._logits(hidden[row : row + num_rows], index), dim=-1)
            targets = torch.tensor(
                state.token_ids[first_target : first_target + num_rows], dtype=torch.int64, device=self.device
            )
            ids, values, ranks = compute_topk_logprobs(logprobs, targets, k)
            entries: list[TokenLogprobs | None] = [None] if first_target == 1 else []
            entries.extend(to_token_logprobs(ids, values, ranks))
            out[req_id] = entries
        return out
