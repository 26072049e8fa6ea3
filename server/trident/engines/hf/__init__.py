"""The reference engine: transformers model classes on PyTorch (CPU, fp32).

- :mod:`.model`: the checkpoint and its encode and prefill roles
- :mod:`.decoder`: continuous-batching decode
- :mod:`.sampling`: token sampling
- :mod:`.stage`: :class:`~.stage.HFStageEngine`, what a stage worker serves
"""
