"""`tokenmill run-batch -i in.jsonl -o out.jsonl`: a Batch API input file run offline, with a progress
bar. Each line goes through the same in-process pipeline as the server's Batch API (batch_exec.py), so
its output line is what the server would write; a failed line gets its error in the output, as OpenAI
writes it. One model answers every line, whatever its `model` field names. (The flags: run_batch_cli.py.)"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.batch_exec import RetryLater, run_line
from tokenmill.server.batch_lines import BatchLine, output_line
from tokenmill.server.config import ServerConfig, ServerState
from tokenmill.server.security import ANONYMOUS


@dataclass(frozen=True)
class BatchCounts:
    total: int
    completed: int
    failed: int


async def run_batch(
    args: EngineArgs, lines: list[BatchLine], output: Path, max_in_flight: int | None = None, use_tqdm: bool = True
) -> BatchCounts:
    """Run `lines` on an engine of `args`, writing their output lines to `output` as they finish."""
    engine = AsyncEngine(args, engine_process=False)
    state = ServerState.create(ServerConfig(), engine)
    state.routed = True  # the one model answers every line
    slots = asyncio.Semaphore(max_in_flight or engine.config.scheduler.max_num_seqs)
    bar = tqdm(total=len(lines), desc="run-batch", unit="req", disable=not use_tqdm)
    failed = 0
    engine.start()
    try:
        with output.open("w") as out:

            async def one(line: BatchLine) -> None:
                nonlocal failed
                async with slots:
                    while True:
                        try:
                            status, body = await run_line(state, ANONYMOUS, line, priority=0)
                            break
                        except RetryLater as later:  # more lines than the queue takes: wait for room
                            await asyncio.sleep(later.seconds)
                out.write(json.dumps(output_line(line.custom_id, status, body), separators=(",", ":")) + "\n")
                failed += status != 200
                bar.update(1)

            await asyncio.gather(*(one(line) for line in lines))
    finally:
        bar.close()
        engine.abort_all()
        await asyncio.to_thread(engine.shutdown)
    return BatchCounts(len(lines), len(lines) - failed, failed)
