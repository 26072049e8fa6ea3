"""The stage protocol's caller side: :class:`StageClient`, used by every caller of a stage worker's socket (the BLS
schedulers, and the encode worker handing its record to a prefill worker). The serving side is the worker's
:class:`~trident.workers.channel.WorkerChannel`; the messages are :mod:`trident.protocol`'s, the frames
:mod:`trident.workers.channel`'s."""

from .client import DirectStream, NotSent, StageClient, responses_of

__all__ = ["DirectStream", "NotSent", "StageClient", "responses_of"]
