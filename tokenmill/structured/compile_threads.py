"""The threads every grammar compiles and validates on, in any process: off the event loop, the prompt
thread and the engine's step loop (llguidance releases the GIL while it builds a grammar), on stacks
deep enough for any grammar within the size cap (limits.py).

llguidance builds a grammar recursively: each level of a chain of rules (`a: b`, `b: c`, ...) takes
about 3 KB of native stack, so a 64 KiB grammar can need some 30 MB, past the 8 MB a thread gets by
default: there the process dies of a segmentation fault, not of an error a request could be told."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

# Virtual address space, committed only as deep grammars touch it: room for MAX_GRAMMAR_BYTES_CEILING.
STACK_BYTES = 256 << 20
# Compiles at once: a slow one delays the next constrained request, never an unconstrained one.
NUM_THREADS = 2

_Job = tuple[Callable[[], object], Future[object]]


class CompileThreads:
    """A few daemon threads with deep stacks, started on first use, taking jobs in order."""

    def __init__(self, num_threads: int = NUM_THREADS, stack_bytes: int = STACK_BYTES) -> None:
        self.num_threads, self.stack_bytes = num_threads, stack_bytes
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()
        self._local = threading.local()

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run `fn(*args)` on a compile thread; its result or exception arrives on the future."""
        self._start()
        future: Future[T] = Future()
        self._jobs.put((lambda: fn(*args), future))  # type: ignore[arg-type]
        return future

    def is_current(self) -> bool:
        """Whether the caller runs on one of these threads."""
        return bool(getattr(self._local, "is_compile_thread", False))

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            # The stack size is process-wide and read when a thread starts: set it for ours only.
            previous = threading.stack_size(self.stack_bytes)
            try:
                for i in range(self.num_threads):
                    threading.Thread(target=self._work, name=f"tokenmill-grammar-{i}", daemon=True).start()
            finally:
                threading.stack_size(previous)
            self._started = True

    def _work(self) -> None:
        self._local.is_compile_thread = True
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)


# One set per process: every engine and front end in it shares them.
COMPILE_THREADS = CompileThreads()
