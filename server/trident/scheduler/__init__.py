"""Trident's scheduler: the BLS entry model of each mode (:mod:`.model`), the path a request takes
(:mod:`.plan`), which stage instance serves it (:mod:`.routing`) and the metrics it publishes
(:mod:`.metrics`). The embedding cache it routes toward lives in the encode workers
(:mod:`trident.engines.embedding_cache`)."""
