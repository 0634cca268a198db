"""OutputProcessor for a caller that does not stream (LLM.generate): only finished requests get a
RequestOutput, and their text and tokens equal those of the streaming mode."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from tests.unit.test_detokenizer import byte_level  # noqa: F401  (a fixture)
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import EngineCoreOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams


def _run(tokenizer: PreTrainedTokenizerFast, only_finished: bool) -> list[list[RequestOutput]]:
    """Two requests fed a token per step; b ends at its stop string, a at its length."""
    processor = OutputProcessor(tokenizer)
    ids = {
        name: tokenizer.encode(text) for name, text in (("a", "héllo wörld, the quick"), ("b", "Stop here, or later"))
    }
    for name in ids:
        stop = ["here"] if name == "b" else []
        processor.add_request(name, None, [1, 2], SamplingParams(max_tokens=20, stop=stop), [name])
    steps, stopped = [], []
    for step in range(max(len(v) for v in ids.values())):
        outputs = []
        for name, tokens in ids.items():
            if step < len(tokens):
                last = step == len(tokens) - 1
                outputs.append(EngineCoreOutput(name, [tokens[step]], finish_reason="length" if last else None))
        results, to_stop = processor.process(outputs, only_finished)
        steps.append(results)
        stopped += to_stop
    assert stopped == ["b"]  # once: the engine is told to stop it, later tokens of b are ignored
    return steps


def test_only_finished_requests_get_outputs_and_they_equal_the_streamed_ones(
    byte_level: PreTrainedTokenizerFast,  # noqa: F811
) -> None:
    streamed = _run(byte_level, only_finished=False)
    final = _run(byte_level, only_finished=True)
    assert all(r.finished for results in final for r in results)
    assert sum(len(results) for results in final) == 2
    assert sum(len(results) for results in streamed) > 2  # one per request and step
    last = {r.request_id: r for results in streamed for r in results if r.finished}
    for results in final:
        for r in results:
            expected = last[r.request_id]
            assert r.outputs[0].text == expected.outputs[0].text
            assert r.outputs[0].token_ids == expected.outputs[0].token_ids
            assert r.outputs[0].finish_reason == expected.outputs[0].finish_reason
    assert last["a"].outputs[0].text == "héllo wörld, the quick"
    assert last["b"].outputs[0].text == "Stop " and last["b"].outputs[0].stop_reason == "here"
