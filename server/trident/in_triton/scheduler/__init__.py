"""Trident's scheduler: the BLS entry model of each mode, a thin Triton adapter (:mod:`.model`) around one request's
way through its mode (:mod:`.flow`, :mod:`.relay`, :mod:`.request`), the path a request takes and which stage instance
serves it (:mod:`.routing`, :mod:`.instances`) and the metrics it publishes (:mod:`.metrics`,
:mod:`.engine_metrics`). The embedding cache it routes toward lives in the encode workers
(:mod:`trident.worker.engines.embedding_cache`)."""
