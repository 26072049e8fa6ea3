"""Loaded at start-up by every Python process of a test server started with ``faults=True``
(:class:`support.served.Server` puts this folder on its ``PYTHONPATH``): once a stage worker imports
``trident.worker.infer``, its handlers are wrapped by :mod:`trident_faults`. Nothing of this is in the serving path."""

import importlib.abc
import importlib.util
import sys

_TARGET = "trident.worker.infer"


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # the real finder finds it; its loader's exec_module then wraps
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import trident_faults

            trident_faults.install(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _WrapOnImport())
