"""The prefill worker's record inbox and the encode worker's hand-off decision (no processes; the end-to-end
path, real workers and NIXL, is in tests/e2e/test_scheduler.py)."""

from __future__ import annotations

import asyncio

import pytest

from trident.core.errors import InvalidRequest, Unavailable
from trident.core.protocol import EmbeddingsRecord, TensorSpec, Transfer
from trident.worker import infer
from trident.core.protocol import HandTo
from trident.worker.infer import Inbox, check_hand_to, hand_on


def _inbox() -> tuple[Inbox, list[bytes]]:
    discarded: list[bytes] = []
    return Inbox(discarded.append), discarded


def run(coro):
    return asyncio.run(coro)


def test_a_record_reaches_its_call_whichever_comes_first():
    async def main():
        inbox, discarded = _inbox()
        waiting = asyncio.ensure_future(inbox.take("t1"))
        await asyncio.sleep(0)
        assert inbox.stats()["waiting_calls"] == 1
        inbox.deliver("t1", b"record-1")
        assert await waiting == b"record-1"
        inbox.deliver("t2", b"record-2")  # before its call
        assert inbox.stats()["early_records"] == 1
        assert await inbox.take("t2") == b"record-2"
        assert discarded == []
        assert inbox.stats() | {"delivered": 0} == {"delivered": 0, "withdrawn": 0, "discarded": 0,
                                                    "waiting_calls": 0, "early_records": 0}

    run(main())


def test_a_withdrawn_call_fails_at_once_and_its_record_is_freed():
    async def main():
        inbox, discarded = _inbox()
        waiting = asyncio.ensure_future(inbox.take("w"))
        await asyncio.sleep(0)
        inbox.withdraw("w")
        with pytest.raises(Unavailable, match="withdrawn"):
            await waiting
        inbox.withdraw("before")  # the withdraw came first: the call, when it comes, fails at once
        with pytest.raises(Unavailable, match="will not come"):
            await asyncio.wait_for(inbox.take("before"), 1)
        inbox.deliver("early", b"r")
        inbox.withdraw("early")
        assert discarded == [b"r"]
        inbox.deliver("early", b"again")  # a record for a withdrawn token is not kept either
        assert discarded == [b"r", b"again"]
        assert inbox.stats()["early_records"] == 0

    run(main())


def test_a_record_nobody_takes_is_freed_when_it_expires(monkeypatch):
    monkeypatch.setattr(infer, "EARLY_S", 0.05)

    async def main():
        inbox, discarded = _inbox()
        inbox.deliver("late", b"r")
        await asyncio.sleep(0.3)  # no other call: its own timer frees it
        assert discarded == [b"r"]
        with pytest.raises(Unavailable):
            await inbox.take("late", wait_s=5)

    run(main())


def test_a_full_inbox_pushes_out_its_oldest_record(monkeypatch):
    monkeypatch.setattr(infer, "MAX_EARLY", 2)

    async def main():
        inbox, discarded = _inbox()
        for i in range(3):
            inbox.deliver(f"t{i}", f"r{i}".encode())
        assert discarded == [b"r0"]
        with pytest.raises(Unavailable, match="pushed out"):
            await inbox.take("t0")
        assert await inbox.take("t2") == b"r2"

    run(main())


def test_a_call_that_waits_too_long_or_goes_away_leaves_nothing_behind():
    async def main():
        inbox, discarded = _inbox()
        with pytest.raises(Unavailable, match="within"):
            await inbox.take("slow", wait_s=0.05)
        assert inbox.stats()["waiting_calls"] == 0
        waiting = asyncio.ensure_future(inbox.take("gone"))
        await asyncio.sleep(0)
        inbox.deliver("gone", b"r")  # delivered ...
        waiting.cancel()  # ... as the call went away (its connection closed) before it ran again
        try:
            got = await waiting  # the call had it (then it is the call's to read or discard) ...
        except asyncio.CancelledError:
            got = None
        assert (got, discarded) in [(b"r", []), (None, [b"r"])]  # ... or the inbox freed it: never lost
        waiting = asyncio.ensure_future(inbox.take("gone-before"))
        await asyncio.sleep(0)
        waiting.cancel()  # gone before any record came
        with pytest.raises(asyncio.CancelledError):
            await waiting
        inbox.deliver("gone-before", b"late")  # nobody will take it: freed at once
        assert discarded[-1] == b"late"
        assert inbox.stats()["waiting_calls"] == 0 and inbox.stats()["early_records"] == 0
        with pytest.raises(InvalidRequest, match="waits on this record token"):
            first = asyncio.ensure_future(inbox.take("twice"))
            await asyncio.sleep(0)
            try:
                await inbox.take("twice")
            finally:
                first.cancel()

    run(main())


@pytest.mark.parametrize("token", ["", "x" * 65])
def test_tokens_are_checked(token):
    inbox, _ = _inbox()
    with pytest.raises(InvalidRequest, match="token"):
        inbox.deliver(token, b"r")


@pytest.mark.parametrize(
    "hand, match",
    [
        (HandTo("decode", "t"), "not a prefill stage instance"),
        (HandTo("../prefill", "t"), "not a prefill stage instance"),
        (HandTo("prefill-01", "t"), "not a prefill stage instance"),
        (HandTo("prefill", ""), "token"),
        (HandTo("prefill", "t" * 65), "token"),
    ],
)
def test_a_bad_hand_to_is_a_clear_400(hand, match):
    with pytest.raises(InvalidRequest, match=match):
        check_hand_to(hand)


def _record(token_counts: list[int]) -> bytes:
    rows = sum(token_counts)
    transfer = Transfer("agent", b"m", (1 << 40, 1 << 30), ((1 << 40, rows * 16),), (TensorSpec("float32", (rows, 4)),),
                        "0123456789abcdef", 2e9, 1 << 41, b"k" * 16)
    return EmbeddingsRecord(transfer=transfer, token_counts=token_counts).encode()


class _Calls:
    def __init__(self, written: bool = True) -> None:
        self.posts: list[tuple] = []
        self.written = written

    async def deliver(self, instance, token, record):
        self.posts.append((instance, token, record))
        return self.written


def test_the_encode_worker_hands_on_only_a_prompt_too_long_for_the_decode_worker():
    record = _record([100, 50])
    calls = _Calls()
    assert not run(hand_on(calls, HandTo("prefill-2", "tok", above=150), record))  # 150 rows: not above
    assert calls.posts == []
    assert run(hand_on(calls, HandTo("prefill-2", "tok", above=149), record))
    assert calls.posts == [("prefill-2", "tok", record)]  # a Deliver message: the record, for the call's token
    assert not run(hand_on(_Calls(written=False), HandTo("prefill", "tok"), record))  # no socket to write to


def test_the_refused_tokens_are_bounded():
    """Withdrawn tokens are remembered (a record that comes later is freed at once), at most MAX_REFUSED of them:
    a flood of withdrawals forgets the oldest instead of growing without bound."""
    async def main():
        inbox, discarded = _inbox()
        for i in range(infer.MAX_REFUSED + 100):
            inbox.withdraw(f"w{i}")
        assert len(inbox._refused) == infer.MAX_REFUSED
        inbox.deliver(f"w{infer.MAX_REFUSED + 99}", b"late")  # (the newest is still refused: freed at once)
        assert discarded == [b"late"]
        inbox.deliver("w0", b"kept")  # (the oldest was forgotten: kept for a call)
        assert await inbox.take("w0") == b"kept"

    run(main())
