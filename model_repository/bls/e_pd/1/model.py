"""Entry model of a Trident mode: the BLS scheduler. Its code is trident/scheduler/model.py."""

from trident.scheduler.model import TritonPythonModel  # noqa: F401
