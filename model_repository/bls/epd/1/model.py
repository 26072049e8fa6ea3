"""Entry model of a Trident mode: the BLS scheduler. Its code is trident/in_triton/scheduler/model.py."""

from trident.in_triton.scheduler.model import TritonPythonModel  # noqa: F401
