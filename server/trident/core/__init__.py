"""The core every process of Trident shares: the stage protocol and its records, settings, errors, auth, tracing,
the stage calls between processes, NIXL transfers, and what a model's prompts are made of (families, media, the
processor, output rules, structured output).

Nothing here runs on its own: the head (:mod:`trident.supervisor`), the stage workers (:mod:`trident.worker`), the
models inside Triton (:mod:`trident.in_triton`) and the OpenAI frontend (:mod:`trident.frontend`) import it."""
