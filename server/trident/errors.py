"""Exceptions shared across Trident's modules.

Every error a user can cause or a peer can trigger has its own class, so callers (and later the Triton
workers) can map it to the right status code and a message naming the problem.
"""


class TridentError(Exception):
    """Base class for all Trident errors."""


class InvalidRequest(TridentError):
    """The request itself is wrong (bad prompt, image count mismatch, bad sampling parameters...)."""


class TransferError(TridentError):
    """Base class for errors of the NIXL transfer layer."""


class MalformedRecord(TransferError):
    """A transfer metadata record could not be decoded or is inconsistent."""


class LeaseExpired(TransferError):
    """The producer's lease on the regions ran out before the consumer read them."""


class PeerUnavailable(TransferError):
    """The producing process is gone or cannot be reached."""


class TransferTimeout(TransferError):
    """A transfer did not complete within the configured time."""


class PoolExhausted(TransferError):
    """A registered memory pool has no free region large enough."""
