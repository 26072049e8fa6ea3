"""Shared fixtures: demo checkpoints (built once per session). Helpers live in ``support``."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One record-signing key for the session: servers the tests start take it from the environment, so a test can
# act as a worker of the deployment (sign a record) or as another deployment (sign with another key).
os.environ.setdefault("TRIDENT_TRANSFER_SECRET", "trident-tests-" + os.urandom(32).hex())
# One torch thread in the tests' own processes, as each worker runs (``threads``: 1). With the suite's servers on both
# cores, a second OpenMP thread spins at every parallel region's barrier waiting for the first: greedy generation of
# the LLaVA demo, 3 x 24 tokens, took 10.1 s of CPU with 2 threads against 1.9 s with one beside two busy processes
# (and 2.0 s of wall time either way on an idle machine).
torch.set_num_threads(1)


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
def shared_servers():
    """The servers several modules of a lane share, one running at a time: the hf servers of the modules in
    ``SHARED_HF`` (:func:`support.shared_media_server`, :func:`support.shared_llava_server`) and the vllm-engine
    servers (:func:`support.vllm_server`, shared by the modules that ask for the same model one after the other: one
    takes a minute or more to start on 2 cores)."""
    from support import OneServerAtATime

    pool = OneServerAtATime()
    yield pool
    pool.close()


@pytest.fixture
def admin(server):
    """A Triton HTTP client of the module's ``server``, closed after the test: a connection left open holds a
    stopping Triton for up to its ``drain_s``, as any client's would."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http)
    yield client
    client.close()


# The modules that share hf servers, in this order: test_media_serving.py ends with the Qwen2-VL server, which
# test_serving.py starts with; test_serving.py ends with the LLaVA server, which the next three go on with. The
# bad-input corpus leaves records unused (their leases expire later), which test_openai.py would find held;
# test_trust.py stops the server.
SHARED_HF = ("test_media_serving.py", "test_serving.py", "test_openai.py", "test_bad_input.py", "test_trust.py")


# Modules moved to run after another: test_vllm_media.py ends with the vLLM Qwen2-VL server that test_vllm_serving.py
# starts with, and test_vllm_migration.py's server (LLaVA, two decode instances) would come between them.
RUN_AFTER = {"test_vllm_migration.py": "test_vllm_serving.py"}

LANES = ("vllm-hosts", "hf-unit-integration")


def lane(nodeid: str) -> str:
    """Which of the suite's two lanes a test runs in (`make test`: ``pytest -n 2``, one lane per process, each in
    the order of :func:`pytest_collection_modifyitems`): the vLLM engine's modules, and the stage hosts with
    test_supervision.py (they go on with one server); the hf engine's servers, then the unit and the integration
    tests. A lane's servers run one at a time and its shared servers are its own. In a run from a clean clone of
    1e13ab6 the first lane's tests took 1585 s, the second's 1606 s (test_hf_families.py, 140-180 s with servers of
    its own, runs in the second to even them out); on a faster machine of the same kind (9d207d0), 1053 and 862 s. Together they use the 2 cores that one lane left
    idle a third of the time."""
    path = nodeid.split("::", 1)[0]
    folder, _, name = path.rpartition("/")
    if name.startswith("test_vllm_") or name == "test_supervision.py" or folder.endswith("/multihost"):
        return LANES[0]
    return LANES[1]


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler with each :func:`lane` as one unit of work: a lane runs whole, in its order, in one
    process; with no server's test collected (the unit and integration tests alone) each module is one. (xdist's own
    ``--dist loadgroup`` marks no group under pytest 9.2, whose node ids it can no longer rewrite.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if self._no_servers():  # the unit and integration tests alone (make test-fast): module by module
                return nodeid.split("::", 1)[0]
            return lane(nodeid)

        def _no_servers(self) -> bool:
            if not hasattr(self, "_fast"):
                self._fast = all(n.split("::", 1)[0].rpartition("/")[0].endswith(("/unit", "/integration"))
                                 for n in self.collection)
            return self._fast

    return Lanes(config, log)


def pytest_collection_modifyitems(session, config, items):
    """The modules that share hf servers run one after the other, after the other hf modules of their lane: a shared
    server is never idle while its lane's other modules run their own (in the other lane, the stage hosts go on with
    test_supervision.py's server).

    A module's ``SERVED_MODES`` (``{server param: its modes, None: all}``) deselects the tests of a ``mode`` its
    ``server`` does not run; a test marked ``servers(names)`` runs only with those ``server`` params."""
    unserved = [i for i in items if _unserved(i)]
    if unserved:
        config.hook.pytest_deselected(items=unserved)
        items[:] = [i for i in items if i not in unserved]
    # tests/multihost's head is the server test_supervision.py goes on with (support.bridged_llava_server)
    hosts = [i for i in items if i.path.parent.name == "multihost"]
    at = next((n for n, i in enumerate(items) if i.path.name == "test_supervision.py"), None)
    if hosts and at is not None:
        rest = [i for i in items if i not in hosts]
        at = next(n for n, i in enumerate(rest) if i.path.name == "test_supervision.py")
        items[:] = rest[:at] + hosts + rest[at:]
    for name, after in RUN_AFTER.items():
        moved, rest = [i for i in items if i.path.name == name], [i for i in items if i.path.name != name]
        ends = [n + 1 for n, i in enumerate(rest) if i.path.name == after]
        if moved and ends:
            items[:] = rest[:ends[-1]] + moved + rest[ends[-1]:]
    shared = [i for i in items if i.path.name in SHARED_HF]
    if not shared:
        return
    rest = [i for i in items if i.path.name not in SHARED_HF]
    at = next((n for n, i in enumerate(rest) if i.path.name.startswith("test_vllm_")),
              next((n for n, i in enumerate(rest) if i.path.parent.name != "e2e"), len(rest)))
    # (a stable sort: each module's own order, parameters grouped as pytest grouped them, stays)
    items[:] = rest[:at] + sorted(shared, key=lambda i: SHARED_HF.index(i.path.name)) + rest[at:]


def _unserved(item) -> bool:
    served = getattr(getattr(item, "module", None), "SERVED_MODES", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    only = item.get_closest_marker("servers")
    if only is not None and "server" in params and params["server"] not in only.args:
        return True
    if not isinstance(served, dict) or "mode" not in params or "server" not in params:
        return False
    modes = served.get(params["server"])
    return modes is not None and params["mode"] not in modes


_LANES_RUN: set[str] = set()


def pytest_runtest_setup(item):
    _LANES_RUN.add(lane(item.nodeid))


def pytest_sessionfinish(session):
    """A lane's CPU seconds, for the summary: its own process's, and those of the processes it started and reaped
    (the servers, with what they reaped in turn; a process killed with its parent is not counted)."""
    import resource

    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (sorted(_LANES_RUN), own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime)
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # (an xdist worker: the controller prints it)
        output["lane_cpu"] = cpu
    elif not session.config.pluginmanager.hasplugin("dsession"):  # (one process, no xdist)
        session.config.stash.setdefault(_LANE_CPU, []).append(cpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    cpu = getattr(node, "workeroutput", {}).get("lane_cpu")
    if cpu is not None:
        node.config.stash.setdefault(_LANE_CPU, []).append(cpu)


_LANE_CPU = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, config):
    """Where the suite's CPU went, lane by lane (the suite is bound by its CPU: README)."""
    for lanes, own, reaped in config.stash.get(_LANE_CPU, []):
        if lanes:
            terminalreporter.write_line(f"CPU of lane {' + '.join(lanes)}: its tests' process {own:.0f} s, the "
                                        f"processes it started (servers, clients) {reaped:.0f} s")
