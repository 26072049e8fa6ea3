"""A stage worker (``trident worker``): one process per stage instance, serving one stage model bound into Triton.

- :mod:`.bind`: builds the engine, asks the head to bind its stage model, keeps its stats file, serves until
  stopped, and sends errors with their status.
- :mod:`.infer`: the inference function of a stage, derived from its :class:`~trident.core.protocol.StageSpec`
  (a stage that hands on embeddings encodes, one that hands on KV prefills, one that hands on tokens generates),
  over the worker's :class:`~trident.worker.engines.base.StageEngine`.
- :mod:`.engines`: the hf and vllm engines behind a stage.
- :mod:`.health`: ``GET /health`` for probes.
"""
