"""The Batch API's runner: each batch's lines run in-process (batch_exec.py) in the idle capacity that
online traffic leaves, and their output lines are appended to disk as they finish, so that a restarted
server resumes every unfinished batch where it stopped (skipping the custom_ids already written).

Online requests go first in three ways: a line is queued in the engine only while the engine serves no
online request (none waits, and every request it runs is a batch line); at most one line runs while
online traffic is recent (scheduling/online_traffic.py), else `--batch-max-in-flight` over all batches; and a
line carries the scheduler's idle priority (BACKGROUND_PRIORITY), so the lines already running sit out
every step an online request wants (and give up their blocks if a waiting one needs them), and while
online traffic is recent compute their prompts in short chunks (a step an arrival waits behind is short)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import IO, Any

from tokenmill.scheduling.online_traffic import OnlineTraffic
from tokenmill.server.batch_exec import RetryLater, run_line
from tokenmill.server.batch_lines import BatchLine, done_custom_ids, output_line, parse_batch_lines
from tokenmill.server.batch_store import BatchRecord, BatchStore
from tokenmill.server.batches_protocol import BatchErrorItem, BatchErrors
from tokenmill.server.config import ServerState
from tokenmill.server.files_store import FileStore

logger = logging.getLogger(__name__)

GATE_POLL_S = 0.005  # how often a line waiting for idle capacity looks again
# While online traffic is recent, one line runs at a time: measured on 2 cores at 2 online
# requests/s, their p99 TTFT moved 1.05x with one line in flight, 1.63x with two, 2.66x with four (before
# the scheduler's short idle-class chunks); a quiet server runs --batch-max-in-flight.


class BatchRunner:
    def __init__(self, state: ServerState, files: FileStore, batches: BatchStore) -> None:
        self.state, self.files, self.batches = state, files, batches
        self._slots = asyncio.Semaphore(state.config.batch_max_in_flight)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._running = 0  # lines queued in the engine now
        self.online = OnlineTraffic()  # monotonic: when the gate saw online requests

    def resume_all(self) -> None:
        """Start every batch a previous server left unfinished."""
        for record in self.batches.records():
            if record.batch.status in ("validating", "in_progress", "finalizing"):
                self.start(record)
            elif record.batch.status == "cancelling":
                self._end(record, "cancelled")

    def start(self, record: BatchRecord) -> None:
        self._tasks[record.batch.id] = asyncio.ensure_future(self._run(record))

    async def cancel(self, record: BatchRecord) -> None:
        """Stop queueing its lines and abort those in flight; what finished stays in its output."""
        record.batch.status, record.batch.cancelling_at = "cancelling", int(time.time())
        self.batches.save(record)
        task = self._tasks.pop(record.batch.id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._end(record, "cancelled")

    async def stop(self) -> None:
        """Shutdown: abort the lines in flight; the batches stay unfinished on disk, to resume."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, record: BatchRecord) -> None:
        batch = record.batch
        try:
            lines = parse_batch_lines(await asyncio.to_thread(self.files.path(batch.input_file_id).read_bytes))
        except (OSError, ValueError) as exc:
            batch.errors = BatchErrors(data=[BatchErrorItem(code="invalid_input_file", message=str(exc))])
            self._end(record, "failed")
            return
        out_path, err_path = self.files.path(record.output_id), self.files.path(record.error_id)
        written, failed = _trimmed(out_path), _trimmed(err_path)
        done = done_custom_ids(written, failed)
        batch.status, batch.in_progress_at = "in_progress", batch.in_progress_at or int(time.time())
        counts = batch.request_counts
        counts.total, counts.completed, counts.failed = len(lines), written.count("\n"), failed.count("\n")
        self.batches.save(record)
        todo = [line for line in lines if line.custom_id not in done]
        with out_path.open("a") as out, err_path.open("a") as err:
            expired = await asyncio.gather(*(self._line(record, line, out, err) for line in todo))
        self._end(record, "expired" if any(expired) else "completed")

    async def _line(self, record: BatchRecord, line: BatchLine, out: IO[str], err: IO[str]) -> bool:
        """Run one line to its output line; True if the batch expired before it ran."""
        batch = record.batch
        async with self._slots:
            while True:
                if batch.expires_at is not None and time.time() > batch.expires_at:
                    error = {"code": "batch_expired", "message": "the batch expired before this request ran."}
                    result = {**output_line(line.custom_id, 0, {}), "response": None, "error": error}
                    status = 0
                    break
                await self._wait_for_idle()
                self._running += 1
                try:
                    status, body = await run_line(self.state, record.owner, line)
                except RetryLater as later:
                    await asyncio.sleep(later.seconds)
                    continue
                finally:
                    self._running -= 1
                result = output_line(line.custom_id, status, body)
                break
        # One write per line, flushed, so a crash loses at most the lines in flight.
        target = out if status == 200 else err
        target.write(json.dumps(result, separators=(",", ":")) + "\n")
        target.flush()
        if status == 200:
            batch.request_counts.completed += 1
        else:
            batch.request_counts.failed += 1
        self.batches.save(record)
        return status == 0

    async def _wait_for_idle(self) -> None:
        """Until the engine serves no online request, and fewer lines run than the traffic allows (one
        while online requests came lately, else --batch-max-in-flight). Every live stream beyond the
        lines in flight is online (a completions line with several prompts counts as online too: the
        gate then errs on the side of online traffic)."""
        engine = self.state.engine
        while True:
            now = time.monotonic()
            if engine.num_in_flight > self._running:  # streams live from their admission: waiting ones too
                self.online.seen(now)
            elif not self.state.draining and engine.waiting_load()[0] == 0 and self._running < self._allowed(now):
                return
            await asyncio.sleep(GATE_POLL_S)

    def _allowed(self, now: float) -> int:
        return 1 if self.online.recent(now) else self.state.config.batch_max_in_flight

    def _end(self, record: BatchRecord, status: Any) -> None:
        """Finalize: the output and error files join the Files API (those with lines), then `status`."""
        batch, now = record.batch, int(time.time())
        self._tasks.pop(batch.id, None)
        if status in ("completed", "cancelled", "expired"):
            batch.status, batch.finalizing_at = "finalizing", batch.finalizing_at or now
            self.batches.save(record)
            for file_id, attr in ((record.output_id, "output_file_id"), (record.error_id, "error_file_id")):
                path = self.files.path(file_id)
                if path.is_file() and path.stat().st_size > 0:
                    self.files.add(record.owner, file_id, f"{batch.id}_{attr.split('_')[0]}.jsonl", "batch_output")
                    setattr(batch, attr, file_id)
                else:
                    path.unlink(missing_ok=True)
        batch.status = status
        setattr(batch, f"{status}_at", now)
        self.batches.save(record)


def _trimmed(path: Path) -> str:
    """The file's complete lines; a last line cut short by a crash is removed, so appends stay lines."""
    if not path.is_file():
        return ""
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        with contextlib.suppress(OSError):
            path.write_text(text)
    return text
