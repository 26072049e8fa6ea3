"""Errors that carry their status.

Every error a client or a peer can cause has its own class with the HTTP status the OpenAI frontend answers
with, the Triton error code a stage model returns (so Triton's HTTP and gRPC endpoints answer with the
matching status), and whether a retry may help. Torch-free: the python-backend stub and the frontend use it.

Across processes a stage worker's error travels as a :class:`~trident.core.protocol.Failure` naming its class; the
stage model's python-backend stub turns it into a Triton error with the class's code and the message
``"<ClassName>: <message>"``. Triton's gRPC stream carries only that message, so a client of a stream reads the
class back with :func:`from_message`; elsewhere the Triton status already says it. An exception that is not a
Trident error (a bug) reaches no client with its own text, which may name a path, an address or a line of code:
the client reads a reference, and the process's log has the exception under it (:func:`as_trident_error`).
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import ClassVar


class TridentError(Exception):
    """Base class of Trident's errors: an internal failure unless a subclass says otherwise."""

    http_status: ClassVar[int] = 500
    triton_code: ClassVar[str] = "INTERNAL"  # name of a pb_utils.TritonError / TRITONSERVER_Error code
    retryable: ClassVar[bool] = False
    retry_after_s: ClassVar[int | None] = None  # the Retry-After an HTTP answer carries

    @property
    def message(self) -> str:
        return str(self)


class InvalidRequest(TridentError):
    """The request itself is wrong (bad prompt, image count mismatch, bad sampling parameters...)."""

    http_status = 400
    triton_code = "INVALID_ARG"


class NotFound(TridentError):
    """An unknown model, mode or stage."""

    http_status = 404
    triton_code = "NOT_FOUND"


class Unavailable(TridentError):
    """A stage, a peer or the server cannot take the request now (down or overloaded); retry later."""

    http_status = 503
    triton_code = "UNAVAILABLE"
    retryable = True
    retry_after_s = 1


class WorkerLost(Unavailable):
    """The stage worker serving the request went away (exited, killed, cut off) before it finished: the scheduler
    moves the request to another instance where it can (``scheduling.migration_limit``)."""


class Cancelled(TridentError):
    """The client went away: its request's last response, which no one reads (HTTP 499, as nginx logs it)."""

    http_status = 499
    triton_code = "CANCELLED"


class StageTimeout(TridentError):
    """A stage instance did not answer a call within the scheduler's deadline (``scheduling.stage_timeout_s``): its
    worker is alive but stuck, or its host stalls. The message names the instance and its host.

    Triton has no timeout code: its endpoints answer 503 (UNAVAILABLE); the OpenAI frontend answers 504."""

    http_status = 504
    triton_code = "UNAVAILABLE"
    retryable = True


class Unauthenticated(TridentError):
    """A stage call that does not prove the deployment secret (no stage credential): refused before any work.

    401 at the OpenAI frontend; Triton has no such code, so a stage model answers INVALID_ARG (400), with the
    class name first in the message."""

    http_status = 401
    triton_code = "INVALID_ARG"


class NameTaken(TridentError):
    """A worker asked to bind as an instance name that another live worker serves (the head's bind model)."""

    http_status = 409
    triton_code = "ALREADY_EXISTS"


class TransferError(TridentError):
    """Base class for errors of the NIXL transfer layer."""


class MalformedRecord(TransferError, InvalidRequest):
    """A transfer metadata record could not be decoded or is inconsistent."""

    http_status = 400
    triton_code = "INVALID_ARG"


class ForgedRecord(MalformedRecord):
    """A record whose signature is not this deployment's, or whose regions lie outside the producer's pool.

    403 at the OpenAI frontend; Triton has no such code, so a stage model answers INVALID_ARG (400)."""

    http_status = 403


class ReplayedRecord(MalformedRecord):
    """A record already used: each one is good for a single READ (or a single discard)."""

    http_status = 403


class PeerUnavailable(TransferError, Unavailable):
    """The producing process is gone or cannot be reached."""


class PoolExhausted(TransferError, Unavailable):
    """A registered memory pool has no free region large enough (too much in flight)."""


class TransferTimeout(TransferError):
    """A transfer did not complete within the configured time.

    Triton has no timeout code: its endpoints answer 503 (UNAVAILABLE); the OpenAI frontend answers 504."""

    http_status = 504
    triton_code = "UNAVAILABLE"
    retryable = True
    aborted: bool = True  # False when NIXL would not stop the READ: it may still write into the local buffer


class LeaseExpired(TransferError):
    """The producer's lease on the regions ran out before the consumer read them (504 like a timeout)."""

    http_status = 504
    triton_code = "UNAVAILABLE"
    retryable = True


ERRORS: dict[str, type[TridentError]] = {
    cls.__name__: cls
    for cls in (
        TridentError, InvalidRequest, NotFound, Unavailable, WorkerLost, Cancelled, Unauthenticated, NameTaken, TransferError, MalformedRecord, ForgedRecord,
        ReplayedRecord, PeerUnavailable,
        PoolExhausted, TransferTimeout, LeaseExpired, StageTimeout,
    )
}
"""Every error class by name: the one table the wire format and the frontend read."""


def as_trident_error(error: BaseException, log: bool = True) -> TridentError:
    """``error`` itself when it is a Trident error; else an internal error that names only a reference, the
    exception (its type, text and traceback) logged under that reference here (``log``: by the caller)."""
    if isinstance(error, TridentError):
        return error
    reference = secrets.token_hex(4)
    if log:
        logging.getLogger("trident").error("internal error %s: %s: %s", reference, type(error).__name__, error,
                                           exc_info=error)
    return TridentError(f"internal error (reference {reference}: the server's log has its cause)")


def client_message(error: TridentError) -> str:
    """What a Triton client reads: ``"<ClassName>: <message>"``."""
    return f"{type(error).__name__}: {error.message}"


# -- what a client of Triton reads back ------------------------------------------------------------------
_NAMED = re.compile(r"\b(" + "|".join(sorted(ERRORS, key=len, reverse=True)) + r"): ")


def from_message(text: str) -> TridentError | None:
    """The Trident error a Triton error message carries (see :func:`client_message`), or None."""
    match = _NAMED.search(text)
    if match is None:
        return None
    message = text[match.end():].split("\n", 1)[0].strip()
    return ERRORS[match.group(1)](message)
