"""Stage workers: each binds one stage model into a running Triton server through PyTriton.

One module per stage model (``encode``, ``prefill``, ``decode``, ``encode_prefill``, ``prefill_decode``,
``generate``) defines its inference function over a :class:`~trident.engines.base.StageEngine`;
:mod:`trident.workers.serve` loads the engine, binds the model and serves until stopped.
"""

STAGES = ("generate", "encode", "prefill", "decode", "encode_prefill", "prefill_decode")
