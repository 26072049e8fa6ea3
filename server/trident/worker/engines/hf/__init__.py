"""The reference engine: transformers model classes on PyTorch (CPU, fp32).

- :mod:`.stage`: the checkpoint and its encode and prefill roles, and :class:`~.stage.HFStageEngine` over them, what
  a stage worker serves
- :mod:`.decoder`: continuous-batching decode
- :mod:`.sampling`: token sampling
"""
