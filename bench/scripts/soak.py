"""Soak test of `tokenmill serve`: mixed traffic for a long while, one engine kill, and an account of every request.

Usage: .venv/bin/python bench/scripts/soak.py [--duration 1800] [--rate R] [--load 0.8] [--kill-at S|none]
           [--hang-at S|none]
           [--window 300] [--port 8021] [--output bench/results/soak.json] [--serve-args "--max-num-seqs 16"]

It starts the server on the embedded default model, measures the saturation request rate with `tokenmill bench serve
--request-rate inf` (unless --rate), then sends Poisson arrivals at --load times that rate: ~80% normal requests
(chat and completions, streamed or not, 64-128 output tokens), ~10% malformed ones that must get a 4xx, ~10% streams
abandoned after a few chunks. At --kill-at seconds (default: half way) it SIGKILLs the engine process and watches
/health until it recovers; at --hang-at (default: three quarters in) it SIGSTOPs the engine, a hang that the engine
watchdog (--engine-step-timeout) must end the same way. Every request ends as completed, errored (an error status or
error frame; a 503 with Retry-After is retried once), rejected_as_expected (a malformed request's 4xx), abandoned,
unexpected (a malformed request answered other than 4xx or 503) or LOST: a reset without an error, no byte for
--client-timeout seconds, a stream without [DONE] or an error frame, a 200 with a malformed body. Exit 1 on any lost
or unexpected request. Per --window: outcomes, p50/p99 TTFT and TPOT of the normal streamed requests, server and
engine RSS. Results go to --output (JSON), the server's log beside it (.serve.log).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
_VENV_TOKENMILL = Path(sys.executable).with_name("tokenmill")
TOKENMILL = str(_VENV_TOKENMILL) if _VENV_TOKENMILL.exists() else shutil.which("tokenmill") or "tokenmill"
PROMPTS = [
    "Tell me a story about a lighthouse.",
    "Explain how a bicycle works.",
    "Write a short poem about rain.",
    "List five uses for a brick.",
    "What makes bread rise?",
    "Describe a harbour city at night.",
]
OUTCOMES = ("completed", "errored", "rejected_as_expected", "abandoned", "unexpected", "lost")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class Record:
    """One request's fate. kind: normal, malformed or abandon; outcome: pending, then one of OUTCOMES."""

    kind: str
    route: str
    sent_s: float  # since the soak's start
    stream: bool = False
    outcome: str = "pending"
    detail: str = ""
    status: int | None = None
    retried: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None


# ---------------------------------------------------------------------- the server and its processes
class Server:
    """`tokenmill serve` in a session of its own, so that its engine and helpers die with it on cleanup."""

    def __init__(self, port: int, extra_args: list[str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        cmd = [TOKENMILL, "serve", "--port", str(port), "--log-level", "warning", *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"the server was not ready within {timeout_s:g} s; see {self.log.name}")

    def engine_pid(self) -> int | None:
        """The multiprocessing child that runs the engine core (not the resource tracker)."""
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            try:
                pids = [int(p) for p in children.read_text().split()]
            except OSError:
                continue
            for pid in pids:
                cmd = cmdline(pid)
                if "spawn_main" in cmd and "resource_tracker" not in cmd:
                    return pid
        return None

    def rss_mb(self) -> dict[str, float | None]:
        engine = self.engine_pid()
        return {"server": rss_mb(self.proc.pid), "engine": rss_mb(engine) if engine else None}

    def stop(self) -> None:
        """SIGTERM (a graceful drain), then SIGKILL to the whole group for whatever is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.log.close()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def engine_restarts(url: str) -> float | None:
    """`tokenmill:engine_restarts_total` summed over its labels; None where the server has no such metric."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("tokenmill:engine_restarts_total{", "tokenmill:engine_restarts_total "))
    ]
    return sum(values) if values else None


def saturation_rate(url: str) -> float:
    """Requests/s at saturation: `tokenmill bench serve --request-rate inf` on short prompts, <= 128 output tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "saturation.json"
        flags = "--workload random-cpu --num-prompts 16 --max-prompt-len 64 --max-output-len 128 --request-rate inf"
        subprocess.run(
            [TOKENMILL, "bench", "serve", "--base-url", url, *flags.split(), "--output-json", str(report)], check=True
        )
        return float(json.loads(report.read_text())["results"][0]["request_throughput"])


# ---------------------------------------------------------------------- requests
def normal_body(rng: random.Random, model: str, route: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(64, 128),
        "ignore_eos": True,
        "temperature": 0.7,
        "stream": stream,
    }
    prompt = rng.choice(PROMPTS)
    body.update({"messages": [{"role": "user", "content": prompt}]} if route == CHAT else {"prompt": prompt})
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def malformed_body(rng: random.Random, model: str) -> tuple[str, str, bytes]:
    """(name, route, raw body) of a request the server must refuse with a 4xx."""
    hi = [{"role": "user", "content": "hi"}]
    cases: dict[str, tuple[str, Any]] = {
        "bad_json": (CHAT, b'{"model": "x", "messages": [{"role": '),
        "wrong_type": (COMPLETIONS, {"model": model, "prompt": "hi", "max_tokens": "ten"}),
        "messages_not_a_list": (CHAT, {"model": model, "messages": "hi"}),
        "unknown_model": (CHAT, {"model": "no-such-model", "messages": hi}),
        "negative_max_tokens": (COMPLETIONS, {"model": model, "prompt": "hi", "max_tokens": -5}),
        # json.dumps writes the lone surrogate as the escape \ud800: valid JSON, not Unicode text
        "lone_surrogate": (CHAT, {"model": model, "messages": [{"role": "user", "content": "hi \ud800"}]}),
        "huge_logit_bias": (
            COMPLETIONS,
            {"model": model, "prompt": "hi", "logit_bias": {str(i): 5 for i in range(5000)}},
        ),
    }
    name = rng.choice(sorted(cases))
    route, body = cases[name]
    return name, route, body if isinstance(body, bytes) else json.dumps(body).encode()


def error_status(rec: Record, status: int, headers: httpx.Headers, text: str) -> float | None:
    """Mark an error answer; return the Retry-After of a 503 that has one (worth one retry)."""
    rec.outcome, rec.status, rec.detail = "errored", status, f"{status}: {text[:160]}"
    if status == 503 and "retry-after" in headers:
        try:
            return min(float(headers["retry-after"]), 10.0)
        except ValueError:
            return 1.0
    return None


async def streamed(
    client: httpx.AsyncClient, rec: Record, body: dict[str, Any], abandon_at: int | None
) -> float | None:
    start = time.perf_counter()
    chunks, done, finish, tokens, first = 0, False, None, None, None
    async with client.stream("POST", rec.route, json=body) as r:
        if r.status_code != 200:
            return error_status(rec, r.status_code, r.headers, (await r.aread()).decode(errors="replace"))
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            if "error" in data:
                rec.outcome, rec.status, rec.detail = "errored", 200, f"error frame: {str(data['error'])[:160]}"
                return None
            for choice in data.get("choices") or []:
                if first is None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                    first = time.perf_counter() - start
                finish = choice.get("finish_reason") or finish
            if data.get("usage"):
                tokens = data["usage"].get("completion_tokens")
            chunks += bool(data.get("choices"))
            if abandon_at is not None and chunks >= abandon_at:
                rec.outcome, rec.detail = "abandoned", f"closed after {chunks} chunks"
                return None  # leaving the block closes the connection mid-stream
    if not done:
        rec.detail = f"the stream ended after {chunks} chunks without [DONE] or an error frame"
    elif finish is None:
        rec.detail = "[DONE] without a finish_reason"
    else:
        rec.outcome, rec.status, rec.ttft_s = "completed", 200, first
        if first is not None and tokens and tokens > 1:
            rec.tpot_s = (time.perf_counter() - start - first) / (tokens - 1)
    return None


async def plain(client: httpx.AsyncClient, rec: Record, body: dict[str, Any]) -> float | None:
    r = await client.post(rec.route, json=body)
    if r.status_code != 200:
        return error_status(rec, r.status_code, r.headers, r.text)
    try:
        finish = r.json()["choices"][0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        finish = None
    if finish:
        rec.outcome, rec.status = "completed", 200
    else:
        rec.detail = f"a 200 with a malformed body: {r.text[:160]}"
    return None


async def generation(client: httpx.AsyncClient, rec: Record, body: dict[str, Any], abandon_at: int | None) -> None:
    for attempt in range(2):  # a 503 with Retry-After (an engine restarting) may be retried once
        retry_after = await (streamed(client, rec, body, abandon_at) if rec.stream else plain(client, rec, body))
        if retry_after is None or attempt == 1:
            return
        rec.retried = True
        await asyncio.sleep(retry_after)


async def malformed(client: httpx.AsyncClient, rec: Record, raw: bytes) -> None:
    r = await client.post(rec.route, content=raw, headers={"content-type": "application/json"})
    rec.status, rec.detail = r.status_code, f"{rec.detail} -> {r.status_code}: {r.text[:120]}"
    # 503: the server may refuse everything while its engine restarts, before it looks at the body
    rec.outcome = (
        "rejected_as_expected" if 400 <= r.status_code < 500 else "errored" if r.status_code == 503 else "unexpected"
    )


async def guarded(rec: Record, work: Coroutine[Any, Any, None], timeout_s: float) -> None:
    """The client's read timeout catches a hang (no byte for `timeout_s`); this bound, a server that trickles."""
    try:
        await asyncio.wait_for(work, 10 * timeout_s)
    except asyncio.TimeoutError:
        rec.outcome, rec.detail = "lost", f"unfinished after {10 * timeout_s:g} s"
    except httpx.TimeoutException as exc:
        rec.outcome, rec.detail = "lost", f"{type(exc).__name__}: no byte for {timeout_s:g} s"
    except httpx.HTTPError as exc:
        rec.outcome, rec.detail = "lost", f"{type(exc).__name__}: {exc}"[:200]
    except json.JSONDecodeError as exc:
        rec.outcome, rec.detail = "lost", f"a frame that is not JSON: {exc}"
    if rec.outcome == "pending":  # ended without a verdict: a stream cut short, a malformed body
        rec.outcome = "lost"


def next_request(
    rng: random.Random, client: httpx.AsyncClient, model: str, sent_s: float
) -> tuple[Record, Coroutine[Any, Any, None]]:
    roll = rng.random()
    if roll < 0.1:
        name, route, raw = malformed_body(rng, model)
        rec = Record("malformed", route, sent_s, detail=name)
        return rec, malformed(client, rec, raw)
    route = rng.choice([CHAT, COMPLETIONS])
    if roll < 0.2:
        rec = Record("abandon", route, sent_s, stream=True)
        return rec, generation(client, rec, normal_body(rng, model, route, True), rng.randint(1, 5))
    rec = Record("normal", route, sent_s, stream=rng.random() < 0.5)
    return rec, generation(client, rec, normal_body(rng, model, route, rec.stream), None)


# ---------------------------------------------------------------------- the soak
async def fault(server: Server, at_s: float, t0: float, info: dict[str, Any], sig: signal.Signals) -> None:
    """Send `sig` to the engine at `at_s` (SIGKILL: a death; SIGSTOP: a hang, which only the engine watchdog
    ends), then watch /health until it has failed and answers 200 again."""
    await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - t0)))
    pid = server.engine_pid()
    if pid is None:
        info["error"] = "no engine process found"
        print(f"{sig.name}: no engine process found", flush=True)
        return
    info.update(pid=pid, cmdline=cmdline(pid), rss_mb=rss_mb(pid), at_s=round(time.perf_counter() - t0, 1))
    os.kill(pid, sig)
    print(f"[{info['at_s']:.0f} s] {sig.name} engine pid {pid}: {info['cmdline']}", flush=True)
    health: Counter[str] = Counter()
    struck = time.perf_counter()
    info["health"], info["recovered_after_s"] = health, None
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        while True:
            status = 0
            try:
                r = await client.get("/health")
                status, code = r.status_code, r.json().get("error", {}).get("code") if r.status_code != 200 else ""
                health[f"{status} {code or ''}".strip()] += 1
            except (httpx.HTTPError, ValueError) as exc:
                health[type(exc).__name__] += 1
            if status == 200 and server.engine_pid() not in (None, pid):
                info["recovered_after_s"] = round(time.perf_counter() - struck, 1)
                info["new_engine_pid"] = server.engine_pid()
                print(
                    f"[{time.perf_counter() - t0:.0f} s] healthy again after {info['recovered_after_s']} s, "
                    f"engine pid {info['new_engine_pid']}",
                    flush=True,
                )
                if sig == signal.SIGSTOP:
                    with contextlib.suppress(ProcessLookupError):  # a stopped engine the watchdog left behind
                        os.kill(pid, signal.SIGKILL)
                return
            await asyncio.sleep(0.5)


async def watch(server: Server, records: list[Record], t0: float, window: float, samples: list[dict]) -> None:
    """RSS every 10 s; a progress line at each window's end."""
    shown = 0
    while True:
        now = time.perf_counter() - t0
        samples.append({"t_s": round(now, 1), **server.rss_mb()})
        if int(now // window) > shown:
            shown = int(now // window)
            counts = Counter(r.outcome for r in records)
            print(f"[{now:.0f} s] sent {len(records)}: " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
        await asyncio.sleep(min(10.0, window))


async def soak(args: argparse.Namespace, server: Server, model: str, rate: float) -> dict[str, Any]:
    rng = random.Random(args.seed)
    records: list[Record] = []
    samples: list[dict] = []
    kill: dict[str, Any] = {}
    hang: dict[str, Any] = {}
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.url, timeout=args.client_timeout, limits=limits) as client:
        helpers = [asyncio.create_task(watch(server, records, t0, args.window, samples))]
        if args.kill_at >= 0:
            helpers.append(asyncio.create_task(fault(server, args.kill_at, t0, kill, signal.SIGKILL)))
        if args.hang_at >= 0:
            helpers.append(asyncio.create_task(fault(server, args.hang_at, t0, hang, signal.SIGSTOP)))
        due = 0.0
        while (due := due + rng.expovariate(rate)) < args.duration:
            await asyncio.sleep(max(0.0, due - (time.perf_counter() - t0)))
            rec, work = next_request(rng, client, model, round(time.perf_counter() - t0, 3))
            records.append(rec)
            tasks.append(asyncio.create_task(guarded(rec, work, args.client_timeout)))
        await asyncio.gather(*tasks)
        for helper in helpers:
            helper.cancel()
    elapsed = time.perf_counter() - t0
    return {"records": records, "rss_samples": samples, "kill": kill, "hang": hang, "elapsed_s": elapsed}


# ---------------------------------------------------------------------- the account
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def windows(records: list[Record], samples: list[dict], window: float, duration: float) -> list[dict[str, Any]]:
    out = []
    for i in range(max(1, math.ceil(duration / window))):
        lo, hi = i * window, (i + 1) * window
        recs = [r for r in records if lo <= r.sent_s < hi]
        timed = [r for r in recs if r.kind == "normal" and r.stream and r.outcome == "completed"]
        ttft = [r.ttft_s * 1000 for r in timed if r.ttft_s is not None]
        tpot = [r.tpot_s * 1000 for r in timed if r.tpot_s is not None]
        rss = [s for s in samples if lo <= s["t_s"] < hi] or [{}]
        out.append(
            {
                "start_s": lo,
                "sent": len(recs),
                **{o: sum(r.outcome == o for r in recs) for o in OUTCOMES},
                "ttft_ms_p50": pct(ttft, 50),
                "ttft_ms_p99": pct(ttft, 99),
                "tpot_ms_p50": pct(tpot, 50),
                "tpot_ms_p99": pct(tpot, 99),
                "server_rss_mb": rss[-1].get("server"),
                "engine_rss_mb": rss[-1].get("engine"),
            }
        )
    return out


def print_table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    cells = [list(headers)] + [
        ["-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v) for v in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        for row in cells:
            print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for row in cells[1:]:
        table.add_row(*row)
    # wide enough for every column, even when the output is a pipe (rich would assume 80)
    Console(width=max(shutil.get_terminal_size().columns, sum(widths) + 3 * len(widths) + 1)).print(table)


def report(args: argparse.Namespace, run: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    records: list[Record] = run["records"]
    by_kind = {k: Counter(r.outcome for r in records if r.kind == k) for k in ("normal", "malformed", "abandon")}
    totals = Counter(r.outcome for r in records)
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "config": {k: v for k, v in vars(args).items() if k != "output"},
        **extra,
        "elapsed_s": round(run["elapsed_s"], 1),
        "sent": len(records),
        "outcomes": {o: totals[o] for o in OUTCOMES},
        "outcomes_by_kind": {k: {o: c[o] for o in OUTCOMES} for k, c in by_kind.items()},
        "retried": sum(r.retried for r in records),
        "success": totals["lost"] == 0 and totals["unexpected"] == 0,
        **{f: {k: dict(v) if isinstance(v, Counter) else v for k, v in run[f].items()} for f in ("kill", "hang")},
        "windows": windows(records, run["rss_samples"], args.window, args.duration),
        "rss_samples": run["rss_samples"],
        "lost_examples": [asdict(r) for r in records if r.outcome == "lost"][:50],
        "unexpected_examples": [asdict(r) for r in records if r.outcome == "unexpected"][:50],
        "error_details": Counter(r.detail[:100] for r in records if r.outcome == "errored").most_common(10),
    }


def summarize(result: dict[str, Any]) -> None:
    rows = [[kind, sum(c.values()), *c.values()] for kind, c in result["outcomes_by_kind"].items()]
    print_table("requests by outcome", ["kind", "sent", *OUTCOMES], rows)
    keys = "sent completed errored abandoned lost ttft_ms_p50 ttft_ms_p99 tpot_ms_p50 tpot_ms_p99".split()
    keys += ["server_rss_mb", "engine_rss_mb"]
    print_table(
        f"per {result['config']['window']:g} s window",
        ["start_s", *keys],
        [[w["start_s"], *(w[k] for k in keys)] for w in result["windows"]],
    )
    start, end = result["rss_mb_start"], result["rss_mb_end"]
    saturation = (
        f" ({result['config']['load']:g} x saturation {result['saturation_rate']:.3f})"
        if result["saturation_rate"]
        else " (given)"
    )
    print(
        f"\nrate {result['rate']:.3f} req/s{saturation}; RSS MB server {start['server']} -> {end['server']}, engine "
        f"{start['engine']} -> {end['engine']}; engine restarts (metrics) {result['engine_restarts']}; "
        f"retried {result['retried']}"
    )
    for name in ("kill", "hang"):
        if result[name]:
            print(f"{name}: {json.dumps(result[name])}")
    verdict = "PASS" if result["success"] else "FAIL"
    print(f"{verdict}: lost {result['outcomes']['lost']}, unexpected {result['outcomes']['unexpected']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: --load x the measured saturation)")
    p.add_argument("--load", type=float, default=0.8, help="share of the saturation rate (default 0.8)")
    p.add_argument(
        "--kill-at",
        default=None,
        help="seconds in to SIGKILL the engine (default duration/2; negative or 'none': never)",
    )
    p.add_argument(
        "--hang-at",
        default=None,
        help="seconds in to SIGSTOP the engine, a hang the engine watchdog must end (default 3/4 of the duration; "
        "negative or 'none': never); give the server a short --engine-step-timeout in --serve-args",
    )
    p.add_argument("--window", type=float, default=300.0, help="seconds per reported window (default 300)")
    p.add_argument(
        "--client-timeout", type=float, default=120.0, help="seconds without a byte that make a request lost"
    )
    p.add_argument("--port", type=int, default=8021)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=ROOT / "bench/results/soak.json")
    p.add_argument("--serve-args", default="", help='extra `tokenmill serve` flags, one string: "--max-num-seqs 8"')
    args = p.parse_args()
    for name, share in (("kill_at", 0.5), ("hang_at", 0.75)):
        given = getattr(args, name)
        at = args.duration * share if given is None else -1.0 if given.lower() == "none" else float(given)
        setattr(args, name, at)
    if args.duration <= 0 or args.window <= 0 or args.load <= 0 or (args.rate is not None and args.rate <= 0):
        p.error("--duration, --window, --load and --rate must be > 0")
    return args


def main() -> int:
    args = parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
    server = Server(args.port, shlex.split(args.serve_args), args.output.with_suffix(".serve.log"))
    try:
        server.wait_ready()
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        saturation = None if args.rate else saturation_rate(server.url)
        if args.rate:  # warm up, as bench serve does, so the first window is not the first request's
            warm = {"model": model, "prompt": "Hi", "max_tokens": 4}
            if (r := httpx.post(f"{server.url}{COMPLETIONS}", json=warm, timeout=300)).status_code != 200:
                raise RuntimeError(f"the warm-up request failed: {r.status_code} {r.text[:200]}")
        rate = args.rate or args.load * (saturation or 0.0)
        print(
            f"soak: {args.duration:g} s at {rate:.3f} req/s against {model} (server pid {server.proc.pid}, "
            f"engine pid {server.engine_pid()})",
            flush=True,
        )
        extra = {"model": model, "saturation_rate": saturation, "rate": rate, "rss_mb_start": server.rss_mb()}
        run = asyncio.run(soak(args, server, model, rate))
        extra.update(rss_mb_end=server.rss_mb(), engine_restarts=engine_restarts(server.url))
    finally:
        server.stop()
    result = report(args, run, extra)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    summarize(result)
    print(f"wrote {args.output}")
    return 0 if result["success"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # main's `finally` has stopped the server
        sys.exit(130)
