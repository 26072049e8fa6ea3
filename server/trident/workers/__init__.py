"""Stage workers: each serves one stage model, bound into a running Triton server by the head's bind model.

- :mod:`.infer`: the inference function of a stage, derived from its :class:`~trident.protocol.StageSpec`
  (a stage that hands on embeddings encodes, one that hands on KV prefills, one that hands on tokens
  generates), over the worker's :class:`~trident.engines.base.StageEngine`.
- :mod:`.bind`: builds the engine, asks the head to bind its stage model, keeps its stats file, serves until
  stopped, and sends errors with their status.
- :mod:`.bind_model`: the head's bind model (runs inside Triton): it writes and loads each worker's stage model.
- :mod:`.proxy_model`: a stage model's python-backend side (runs inside Triton): requests to stage calls.
"""
