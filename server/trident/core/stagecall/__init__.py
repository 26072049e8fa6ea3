"""The stage protocol's two sides, over one framed stream (:mod:`.frames`) of :data:`trident.core.protocol.StageMessage`:
:class:`StageServer` in each stage worker, and the callers' :class:`StageClient` (the BLS schedulers, the encode worker
handing its record on) and :class:`StageLink` (a stage model's python-backend stub, which has no event loop)."""

from trident.core.stagecall.client import DirectStream, NotSent, NoWorker, StageClient, StageLink, responses_of
from trident.core.stagecall.server import StageServer

__all__ = ["DirectStream", "NotSent", "NoWorker", "StageClient", "StageLink", "StageServer", "responses_of"]
