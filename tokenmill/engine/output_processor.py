"""Turns per-step core outputs into RequestOutputs: detokenizes, applies stop strings, gathers n > 1."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.token_texts import token_texts
from tokenmill.outputs import CompletionOutput, EngineCoreOutput, RequestOutput, TokenLogprobs
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""  # text added by the latest step, for streaming

    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer else ""

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text(),
            token_ids=list(self.token_ids),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            delta_text=self.delta_text,
        )


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    prompt_logprobs: list[TokenLogprobs | None] | None
    error: str | None = None
    pooled: list[float] | None = None  # a pooling request's result

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    """Child request ids are `{request_id}` for n == 1 and `{request_id}#{i}` otherwise."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        pooling: bool = False,
    ) -> None:
        """`pooling`: the request pools (an embedding): it generates no text to detokenize."""
        sequences = [
            _Sequence(i, None if pooling else self._detokenizer(prompt_token_ids, params))
            for i in range(len(child_ids))
        ]
        for seq in sequences if params.logprobs is not None else []:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        wants_prompt_lps = params.prompt_logprobs is not None
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, sequences, [] if wants_prompt_lps else None
        )
        for i, child_id in enumerate(child_ids):
            self.child_to_parent[child_id] = (request_id, i)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            params.skip_special_tokens,
            params.stop,
            params.include_stop_str_in_output,
        )

    def process(
        self, outputs: list[EngineCoreOutput], only_finished: bool = False
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs that changed (`only_finished`: of the requests that finished: a
        caller that does not stream need not pay for the others' every step), and child ids the core
        must stop (stop strings)."""
        changed: dict[str, _RequestState] = {}
        to_stop: list[str] = []
        for out in outputs:
            parent = self.child_to_parent.get(out.req_id)
            if parent is None:
                continue
            state = self.requests[parent[0]]
            seq = state.sequences[parent[1]]
            if self._apply(state, seq, out, deltas=not only_finished):
                to_stop.append(out.req_id)
            if seq.finish_reason is not None:
                del self.child_to_parent[out.req_id]
            # A chunk of prompt logprobs alone (a long prompt's prefill in chunks) is kept until the
            # first token comes: an output carries the prompt's logprobs whole or not at all.
            if out.new_token_ids or out.finish_reason is not None or out.error is not None:
                changed[state.request_id] = state
        results = [self._to_output(state) for state in changed.values() if state.finished or not only_finished]
        for state in changed.values():
            for seq in state.sequences:
                seq.delta_text = ""
            if state.finished:
                del self.requests[state.request_id]
        return results, to_stop

    def _apply(self, state: _RequestState, seq: _Sequence, out: EngineCoreOutput, deltas: bool) -> bool:
        """Fold one core output into a sequence; True when a stop string ended it. `deltas`: keep each
        step's new text for streaming (else only a finished sequence's text is complete)."""
        # Child 0 alone computes the shared prompt's logprobs (InputProcessor._fan_out): they are every choice's.
        if out.new_prompt_logprobs and state.prompt_logprobs is not None and seq.index == 0:
            if out.new_prompt_logprobs[0] is None:  # a chunk from position 0: a recompute starts over
                state.prompt_logprobs.clear()
            self._decode_tokens(out.new_prompt_logprobs)
            state.prompt_logprobs.extend(out.new_prompt_logprobs)
        if out.error is not None:
            state.error = out.error
        if out.pooled is not None:
            state.pooled = out.pooled
        stopped_by_string = False
        if out.new_token_ids:
            new_ids = out.new_token_ids  # several with speculative decoding
            if seq.detokenizer is not None:
                stop_str = seq.detokenizer.update(new_ids)
                # Nothing after the token that completed a stop string is emitted.
                new_ids = new_ids[: seq.detokenizer.num_used]
                if stop_str is not None and out.finish_reason is None:
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
                    stopped_by_string = True
            seq.token_ids.extend(new_ids)
            if seq.logprobs is not None and out.new_logprobs is not None:
                entries = out.new_logprobs[: len(new_ids)]
                self._decode_tokens(entries)
                seq.logprobs.extend(entries)
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(
                    entry[token].logprob for entry, token in zip(entries, new_ids)
                )
        if out.finish_reason is not None and seq.finish_reason is None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if seq.detokenizer is not None and (deltas or seq.finish_reason is not None):
            # At the finish this also flushes tokens held back for an unfinished character.
            seq.delta_text = seq.detokenizer.get_next_delta(final=seq.finish_reason is not None)
        return stopped_by_string

    def _decode_tokens(self, entries: Iterable[TokenLogprobs | None]) -> None:
        """Fill in each logprob's token text, in place: a dict hit per entry once an id has been seen."""
        if self.tokenizer is not None:
            texts = token_texts(self.tokenizer)
            for entry in entries:
                for tok, lp in (entry or {}).items():
                    lp.decoded_token = texts[tok]

    def _to_output(self, state: _RequestState) -> RequestOutput:
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[seq.to_output() for seq in state.sequences],
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            error=state.error,
            pooled=state.pooled,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.sequences:
            seq.finish_reason = seq.finish_reason or "abort"
        for child_id in [c for c, (p, _) in self.child_to_parent.items() if p == request_id]:
            del self.child_to_parent[child_id]
        return self._to_output(state)
