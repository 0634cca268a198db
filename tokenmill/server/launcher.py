"""Run the server under uvicorn with a graceful SIGTERM:

1. stop accepting: new requests get 503, /ready turns 503 (the socket stays open so they hear it);
2. let in-flight requests finish for up to `shutdown_timeout_s`;
3. abort the rest (their responses end with finish_reason "abort"), then exit with status 0.

A second SIGTERM or Ctrl-C exits at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from types import FrameType

import uvicorn

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.process_tuning import freeze_startup_heap
from tokenmill.engine.restart_policy import RestartPolicy
from tokenmill.loader.generation_config import describe_sampling_defaults
from tokenmill.server.app import build_app
from tokenmill.server.config import ServerConfig, ServerState
from tokenmill.server.header_deadline import header_deadline_protocol
from tokenmill.server.hosts import is_loopback
from tokenmill.server.pool.setup import create_state
from tokenmill.startup_phases import StartupPhases

logger = logging.getLogger(__name__)

# After the drain, uvicorn's own wait for open responses to flush.
_FLUSH_TIMEOUT_S = 5


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.on_started: list[object] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            for callback in self.on_started:
                callback(self)  # type: ignore[operator]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            self.force_exit = self.state.draining
            super().handle_exit(sig, frame)
            return
        self.state.draining = True  # from now on new requests get 503
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        engine, timeout = self.state.engine, self.state.config.shutdown_timeout_s
        logger.warning(
            "shutting down: %d requests in flight get up to %.0f s to finish; new requests get 503 "
            "(signal again to stop now)",
            engine.num_in_flight,
            timeout,
        )
        deadline = time.monotonic() + timeout
        if not await engine.wait_idle(timeout):
            logger.warning("aborting %d requests still in flight", engine.num_in_flight)
            engine.abort_all()
        if self.state.models is not None:  # the other models' requests get what is left of the timeout
            await self.state.models.drain_all(max(0.0, deadline - time.monotonic()))
        await asyncio.sleep(0.1)  # let the handlers write their last bytes
        self.should_exit = True

    def bound_port(self) -> int:
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.config.port


def make_server(state: ServerState, log_level: str = "info") -> GracefulServer:
    app = build_app(state)
    c = state.config
    config = uvicorn.Config(
        app,
        host=c.host,
        port=c.port,
        log_level=log_level,
        # JSON logs: uvicorn's loggers keep the root's JSON handler instead of their own text ones
        log_config=None if c.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        timeout_graceful_shutdown=_FLUSH_TIMEOUT_S,
        access_log=log_level == "debug",
        ssl_certfile=c.ssl_certfile,
        ssl_keyfile=c.ssl_keyfile,
        ssl_ca_certs=c.ssl_ca_certs,
        ssl_cert_reqs=c.ssl_cert_reqs,
        limit_concurrency=c.limit_concurrency,
        http=header_deadline_protocol(c.header_read_timeout_s),
        # X-Forwarded-For only from the proxies named, never by uvicorn's defaults ($FORWARDED_ALLOW_IPS, loopback)
        proxy_headers=bool(c.forwarded_allow_ips),
        forwarded_allow_ips=list(c.forwarded_allow_ips) or None,
    )
    return GracefulServer(config, state)


def print_usage(server: GracefulServer) -> None:
    state, host = server.state, server.config.host
    scheme = "https" if state.config.tls else "http"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    url = f"{scheme}://{host}:{server.bound_port()}"
    key = "$TOKENMILL_API_KEY" if state.keys.enabled else "unused"
    auth = ' -H "Authorization: Bearer $TOKENMILL_API_KEY"' if state.keys.enabled else ""
    sampling = describe_sampling_defaults(state.engine.config.model.generation_config, state.sampling_defaults)
    print(
        f"""
tokenmill is serving {state.model_name!r} at {url}/v1 (OpenAI-compatible; Ctrl-C to stop)
{sampling}

  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{state.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c 'from openai import OpenAI; c = OpenAI(base_url="{url}/v1", api_key="{key}"); \\
print(c.chat.completions.create(model="{state.model_name}", \\
messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content)'

  health {url}/health · metrics {url}/metrics · API docs {url}/docs
""",
        flush=True,
    )


def serve(
    engine_args: EngineArgs, config: ServerConfig, log_level: str = "info", phases: StartupPhases | None = None
) -> None:
    """Load the model, then serve until SIGTERM / Ctrl-C. The engine process is spawned first and loads the
    model while this process builds the app; `phases` logs where the start-up's seconds went."""
    phases = phases if phases is not None else StartupPhases()
    engine = AsyncEngine(
        engine_args,
        config.engine_stall_timeout_s,
        engine_process=not config.engine_in_thread,
        restart_policy=RestartPolicy(max_restarts=config.max_engine_restarts),
        step_timeout_s=config.engine_step_timeout_s,
        phases=phases,
        wait_ready=False,
    )
    try:
        with phases.phase("app"):
            state = create_state(config, engine, engine_args)
            server = make_server(state, log_level)
    except BaseException:
        engine.client.kill()  # Ctrl-C or a bad setting: the engine process must not outlive us
        raise
    engine.wait_ready()
    if config.host not in ("127.0.0.1", "localhost", "::1") and not state.keys.enabled:
        logger.warning(
            "listening on %s without an API key: anyone who can reach it can use it "
            "(set --api-key or TOKENMILL_API_KEY)",
            config.host,
        )
    if not is_loopback(config.host) and not config.allowed_hosts:
        logger.warning(
            "listening on %s without --allowed-hosts: requests with any Host header are answered",
            config.host,
        )
    # The tokenizer, templates and the app's modules stay alive for good: out of the cyclic collector's
    # reach, its full collections (~0.1 s, on the event loop) no longer stall every stream now and then.
    # No collection first: it would delay readiness, for a few start-up cycles kept until exit.
    freeze_startup_heap(collect=False)
    server.on_started.append(lambda _server: phases.ready())
    server.on_started.append(print_usage)
    server.run()
    if server.state.engine.failed:
        sys.exit(1)
