"""Lets go of the BLS entry model's finished stage streams only where the python-backend stub can't free them
without the GIL.

The stub (r24.10, which PyTriton 0.7 ships; its main branch still does the same) keeps every decoupled BLS
response iterator in a map of its own as well as in the Python object ``async_exec`` returns. When the last
response has been read, the iterator queues a clean-up message; the stub's utils thread later sends it to Triton
and drops the map's reference. If Python has let go of the iterator by then, that thread destroys it, and with it
every response and tensor (numpy array) it held, **without holding the GIL**. Python's heap is then corrupted:
the BLS stub segfaulted inside ``libpython`` under load (gdb on a loaded e_p_d stub: 167 of 1186 iterators were
destroyed that way).

The utils thread works through its queue in order. So once a request's ``is_cancelled()``, asked after a
stream's last response was read, has come back ``False`` (a round trip through that same queue; a ``True``
answer may be cached, with no round trip), the stub has let go of the stream and Python's reference is the last:
it is freed under the GIL. :class:`StreamKeeper` holds finished streams until such an answer. The question must
come from a request still being answered: asked after its final response, it makes Triton read a freed response
factory (Triton itself segfaulted in ``TRITONBACKEND_ResponseFactoryIsCancelled``), so the streams a request
finishes are let go by the cancel checks of the requests after it.
"""

from __future__ import annotations

import threading
from typing import Any


def drain(stream: Any) -> None:
    """Read a stage stream to its end (at once if it has ended). The iterator queues its clean-up only when its
    last response is read; an iterator left unread stays in the stub's map for good, with its responses."""
    while True:
        try:
            next(stream)  # not a for loop: iterating a finished iterator again starts over
        except StopIteration:
            return


class StreamKeeper:
    """Finished stage streams (read to their end), held until the stub has surely let go of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[Any] = []

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, stream: Any) -> None:
        with self._lock:
            self._kept.append(stream)

    def is_cancelled(self, request: Any) -> bool:
        """``request.is_cancelled()`` (from a thread that may block on IPC, before the request's final response),
        letting go of the streams kept before it when the answer made the round trip (``False``)."""
        with self._lock:
            kept, self._kept = self._kept, []
        try:
            cancelled = request.is_cancelled()
        except BaseException:
            self._put_back(kept)
            raise
        if cancelled:
            self._put_back(kept)
        return cancelled  # on False, ``kept`` goes here, under the GIL

    def _put_back(self, kept: list[Any]) -> None:
        with self._lock:
            self._kept[:0] = kept

    def clear(self) -> None:
        """At finalize: let go of everything (the stub is stopping)."""
        with self._lock:
            self._kept.clear()
