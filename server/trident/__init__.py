"""Trident: disaggregated Encode / Prefill / Decode serving of multimodal LLMs on NVIDIA Triton."""

__version__ = "0.1.0"
