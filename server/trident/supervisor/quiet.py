"""The environment that keeps the libraries a stage worker imports quiet, unless the operator set it: NIXL logs every
agent it makes at INFO, transformers draws a progress bar per checkpoint load, and vLLM warns about its environment
as it is imported (a CPU build: "Triton is installed, but doesn't include CPU backend"; setup/vllm_cpu_sitecustomize.py
holds it to this level), and torch's C++ side warns about its NUMA binding in each vLLM engine on a CPU.
``trident serve``, ``trident node`` and ``trident worker`` start their workers with it."""

from __future__ import annotations

from typing import MutableMapping

from trident.core.config import VLLMConfig


def quiet(env: MutableMapping[str, str], vllm_log_level: str = VLLMConfig().log_level) -> None:
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", vllm_log_level)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")  # (its processors' advice, e.g. on Qwen2-VL's video pixel cap)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # (vLLM on torch's deprecated names, at import)
