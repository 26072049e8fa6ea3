"""A server that runs in a thread of its own with its own event loop, in the head: the HTTP and gRPC fronts."""

from __future__ import annotations

import asyncio
import threading

from trident.supervisor.startup import StartupError


class LoopThread:
    """:meth:`start` runs :meth:`_serve` on a new event loop in a thread and returns once it has called
    ``started.set()`` (or failed: a :class:`StartupError` naming ``what``); :meth:`stop` sets ``self._stopped``,
    on which ``_serve`` waits, and joins the thread."""

    what = "a server"  # (what a failed start names)

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    async def _serve(self, started: threading.Event) -> None:
        raise NotImplementedError

    def _new_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.new_event_loop()

    def start(self) -> None:
        started = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(started, failed), name=self.what, daemon=True)
        self._thread.start()
        started.wait()
        if failed:
            raise StartupError(f"{self.what} did not start: {failed[0]}")

    def _run(self, started: threading.Event, failed: list) -> None:
        loop = self._loop = self._new_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._until_stopped(started))
        except BaseException as e:  # noqa: BLE001 - told to start() when it happens there
            failed.append(e)
            started.set()
        finally:
            loop.close()

    async def _until_stopped(self, started: threading.Event) -> None:
        self._stopped = asyncio.Event()
        await self._serve(started)

    def stop(self) -> None:
        """End :meth:`_serve` (it closes what it serves) and the thread."""
        if self._loop is not None and self._stopped is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
