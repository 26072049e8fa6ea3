"""Stage workers: each binds one stage model into a running Triton server through PyTriton.

- :mod:`.infer`: the inference function of a stage, derived from its :class:`~trident.protocol.StageSpec`
  (a stage that hands on embeddings encodes, one that hands on KV prefills, one that hands on tokens
  generates), over the worker's :class:`~trident.engines.base.StageEngine`.
- :mod:`.bind`: builds the engine, binds the stage model, keeps its stats file, serves until stopped, and
  sends errors with their status.
- :mod:`.proxy_model`: the python-backend side of the binding (PyTriton's proxy, with error codes).
"""
