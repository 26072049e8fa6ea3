"""E/P/D's embeddings record, handed by the encode worker straight to the prefill worker.

Without it the record goes encode worker -> scheduler -> prefill worker: the encode's answer, the scheduler's
turn and the prefill call's way in, each a process hand-off (``make bench-hops``). With it the scheduler posts
the prefill call beside the encode call (its :class:`~trident.protocol.Call` has ``await_record``: a token instead
of the record) and tells the encode worker where the record goes (the encode call's ``hand_to``). The encode
worker writes the record to that prefill worker's stage socket (a :class:`~trident.protocol.Deliver` message) before it answers the scheduler, and the prefill call, waiting for it before
it takes its slot, then runs as if it had brought the record itself.

Who frees what: a delivered record belongs to the prefill worker's :class:`Inbox`, which reads it (the call
waiting for it) or discards it (its producer frees it at once): a record whose call does not come within
:data:`EARLY_S`, one pushed out of a full inbox, or one whose token was withdrawn. The scheduler withdraws
(a :class:`~trident.protocol.Withdraw` message) every posted call whose record will not come: the encode failed, or did
not hand the record on (a prompt short enough for the decode worker to prefill, or no socket to write to).
A call whose token was withdrawn or whose record was discarded fails at once (503); one that waits longer
than :data:`WAIT_S` fails too, a backstop only.

The two fields are honoured only on a worker's stage socket: the stub's connection, which carries the calls of
Triton's clients, clears them, so no client can make a prefill call wait or an encode worker hand its record
elsewhere; they are still checked (a token's length, a target that is a prefill instance).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Callable

from ..errors import InvalidRequest, TridentError, Unavailable
from ..protocol import EmbeddingsRecord, HandTo, decode_record, parse_instance

EARLY_S = 30.0  # how long a record waits for its call (the two come on different sockets, in either order)
WAIT_S = 300.0  # how long a call waits for its record at most (the scheduler withdraws it before, as a rule)
MAX_EARLY = 64  # records waiting for their calls; one more pushes the oldest out
MAX_TOKEN = 64  # characters of a token


def check_hand_to(hand: HandTo) -> HandTo:
    """An encode call's :class:`~trident.protocol.HandTo`, checked: a prefill instance's name and a token."""
    parsed = parse_instance(hand.instance)
    if parsed is None or parsed[0] != "prefill":
        raise InvalidRequest(f"hand_to names {hand.instance!r}, not a prefill stage instance")
    check_token(hand.token)
    return hand


def check_token(token: str) -> str:
    if not token or len(token) > MAX_TOKEN:
        raise InvalidRequest(f"a record token must be 1-{MAX_TOKEN} characters")
    return token


async def hand_on(calls, hand: HandTo, record: bytes) -> bool:
    """The encode worker's side: write ``record`` to ``hand.instance``'s worker (``calls``: a
    :class:`~trident.stagecall.StageClient`) when the prompt is long enough for a prefill worker. True
    when written: the prefill worker's inbox has it from then on (its answer is not waited for: that worker's
    event loop may be in a prefill for the next 100 ms, and this encode worker has the next image to encode)."""
    if sum(decode_record(record, EmbeddingsRecord).token_counts) <= hand.above:
        return False
    return await calls.deliver(hand.instance, hand.token, record)


class Inbox:
    """The prefill worker's side: records delivered for posted calls, and the calls waiting for them, by token.
    ``discard(record)`` frees a record no call will read. Runs on one event loop."""

    def __init__(self, discard: Callable[[bytes], None]) -> None:
        self._discard = discard
        self._calls: dict[str, asyncio.Future] = {}
        self._records: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # token -> (record, when it goes)
        self._refused: dict[str, float] = {}  # token -> when it goes: withdrawn, or its record freed unread
        self.delivered = self.withdrawn = self.discarded = 0

    def deliver(self, token: str, record: bytes) -> None:
        """A record for ``token``'s call: to the call if it waits, else kept for it (the inbox owns it either way)."""
        self._expire()
        self.delivered += 1
        call = self._calls.pop(check_token(token), None)
        if call is not None and not call.done():
            call.set_result(record)
            return
        if token in self._records or token in self._refused:  # a second record under one token, or a refused one
            self._drop(record)
            return
        if len(self._records) >= MAX_EARLY:  # push the oldest out
            oldest, (dropped, _) = self._records.popitem(last=False)
            self._drop(dropped)
            self._refuse(oldest)
        self._records[token] = (record, time.monotonic() + EARLY_S)
        asyncio.get_running_loop().call_later(EARLY_S + 0.1, self._expire)  # even if nothing else comes

    def withdraw(self, token: str) -> None:
        """``token``'s call gets no record: it fails at once, or when it comes."""
        self._expire()
        self.withdrawn += 1
        call = self._calls.pop(check_token(token), None)
        if call is not None and not call.done():
            call.set_exception(Unavailable("the record this prefill call waited for will not come (withdrawn)"))
            return
        if token in self._records:
            self._drop(self._records.pop(token)[0])
        self._refuse(token)

    async def take(self, token: str, wait_s: float = WAIT_S) -> bytes:
        """``token``'s record, once delivered."""
        self._expire()
        if check_token(token) in self._records:
            return self._records.pop(token)[0]
        if self._refused.pop(token, None) is not None:
            raise Unavailable("the record this prefill call waits for will not come (withdrawn, or pushed out "
                              "of a full inbox)")
        if token in self._calls:
            raise InvalidRequest("another prefill call waits on this record token")
        call = self._calls[token] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(call), wait_s)
        except asyncio.TimeoutError:
            self._refuse(token)  # a record that comes now is freed at once
            raise Unavailable(f"no record came for this prefill call within {wait_s:.0f} s") from None
        except asyncio.CancelledError:  # the call went away (its connection closed, the worker stops)
            if call.done() and not call.cancelled() and call.exception() is None:
                self._drop(call.result())  # delivered as it went: nobody will read it
            else:
                self._refuse(token)
            raise
        finally:
            if self._calls.get(token) is call:
                del self._calls[token]

    def stats(self) -> dict:
        return {"delivered": self.delivered, "withdrawn": self.withdrawn, "discarded": self.discarded,
                "waiting_calls": len(self._calls), "early_records": len(self._records)}

    def _refuse(self, token: str) -> None:
        self._refused[token] = time.monotonic() + EARLY_S

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, (_, deadline) in self._records.items() if deadline <= now]:
            self._drop(self._records.pop(token)[0])
        for token in [t for t, deadline in self._refused.items() if deadline <= now]:
            del self._refused[token]

    def _drop(self, record: bytes) -> None:
        self.discarded += 1
        try:
            self._discard(record)
        except TridentError:  # not a record of ours to free: nothing to give back
            pass
