"""Shared fixtures: demo checkpoints (built once per session). Helpers live in ``support``."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One record-signing key for the session: servers the tests start take it from the environment, so a test can
# act as a worker of the deployment (sign a record) or as another deployment (sign with another key).
os.environ.setdefault("TRIDENT_TRANSFER_SECRET", "trident-tests-" + os.urandom(8).hex())
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory):
    """Folder of each demo arch's checkpoint: ``demo_models["llava"]``."""
    from trident.dev.demo import ARCHS, build_demo_model

    root = tmp_path_factory.mktemp("demo")
    paths = {}
    for arch in ARCHS:
        build_demo_model(arch, root / arch, log=lambda *_: None)
        paths[arch] = str(root / arch)
    return paths


@pytest.fixture(scope="session")
def vllm_servers():
    """The vllm-engine servers, one at a time, shared by the modules that ask for the same model one after the
    other (:func:`support.vllm_server`): a vLLM server takes minutes to start on 2 cores."""
    from support import OneServerAtATime

    pool = OneServerAtATime()
    yield pool
    pool.close()
