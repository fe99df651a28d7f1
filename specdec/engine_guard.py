"""One engine, several callers: the guard that serialises what they do to it."""

from __future__ import annotations

import threading


class EngineGuard:
    """Serialises the engine work of ``stream``/``generate`` calls made on several threads (each step, each
    submission and each clean-up holds it), so their requests share the batch as interleaved streams of one
    thread do. A call made on the thread that already holds it (from inside an engine step) would corrupt
    that step: it raises RuntimeError instead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None

    def __enter__(self) -> EngineGuard:
        me = threading.get_ident()
        if self._holder == me:
            raise RuntimeError("SpecEngine was called from inside one of its own steps on the same thread (a "
                               "callback that generates?); run the nested generation after the step returns")
        self._lock.acquire()
        self._holder = me
        return self

    def __exit__(self, *exc) -> None:
        self._holder = None
        self._lock.release()
