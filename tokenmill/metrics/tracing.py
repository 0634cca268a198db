"""Per-request spans through OpenTelemetry (`--otlp-traces-endpoint`; the optional extra `otel`).

A finished request becomes one span, `llm_request`, with three children drawn from the request's own
core timings: `queued` (arrival to first scheduled), `prefill` (to the first token) and `decode` (to the
finish), carrying token counts. Never prompts or outputs."""

from __future__ import annotations

import time
from typing import Any

from tokenmill.engine.async_engine import RequestStream
from tokenmill.outputs import RequestOutput

INSTALL_HINT = "--otlp-traces-endpoint needs OpenTelemetry: pip install 'tokenmill[otel]'"


class RequestTracer:
    def __init__(self, endpoint: str | None, service_name: str = "tokenmill", exporter: Any = None) -> None:
        """Spans go to `exporter` if given (tests), else over OTLP/HTTP to `endpoint`."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

            if exporter is None:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                exporter = OTLPSpanExporter(endpoint=endpoint)
                processor: Any = BatchSpanProcessor(exporter)  # exports off the event loop, in batches
            else:
                processor = SimpleSpanProcessor(exporter)
        except ImportError as exc:
            raise ValueError(INSTALL_HINT) from exc
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("tokenmill")

    def on_finished(self, stream: RequestStream, output: RequestOutput, model_name: str) -> None:
        m = stream.metrics()
        to_ns = time.time_ns() - time.monotonic_ns()  # the timings are monotonic; spans want epoch ns

        def ns(t: float) -> int:
            return int(t * 1e9) + to_ns

        end = m.finished_time if m.finished_time is not None else time.monotonic()
        reasons = [o.finish_reason or "abort" for o in output.outputs]
        root = self.tracer.start_span("llm_request", start_time=ns(m.arrival_time))
        root.set_attributes(
            {
                "tokenmill.request_id": stream.request_id,
                "gen_ai.request.model": model_name,
                "gen_ai.usage.input_tokens": stream.num_prompt_tokens,
                "gen_ai.usage.output_tokens": stream.num_output_tokens,
                "gen_ai.response.finish_reasons": reasons,
                "tokenmill.num_preemptions": m.num_preemptions,
                "tokenmill.num_cached_tokens": m.num_cached_tokens,
            }
        )
        if output.error:
            root.set_attribute("error.type", "engine_error")
        context = _context_of(root)
        phases = [
            ("queued", m.arrival_time, m.first_scheduled_time, {}),
            (
                "prefill",
                m.first_scheduled_time,
                m.first_token_time,
                {"tokenmill.prompt_tokens": stream.num_prompt_tokens},
            ),
            ("decode", m.first_token_time, m.finished_time, {"tokenmill.output_tokens": stream.num_output_tokens}),
        ]
        for name, start, stop, attributes in phases:
            if start is not None and stop is not None:
                span = self.tracer.start_span(name, context=context, start_time=ns(start), attributes=attributes)
                span.end(end_time=ns(stop))
        root.end(end_time=ns(end))

    def shutdown(self) -> None:
        """Export what is still queued."""
        self.provider.shutdown()


def _context_of(span: Any) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)
