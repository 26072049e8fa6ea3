"""Engines behind the stage workers; role interfaces in :mod:`trident.engines.base`."""
