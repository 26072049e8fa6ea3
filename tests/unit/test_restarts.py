"""When a supervised process starts again (supervisor/restarts.py), on a clock the test moves."""

from trident.supervisor.restarts import MAX_QUICK_DEATHS, PAUSE_S, QUICK_DEATH_S, Restarts


def _deaths(r: Restarts, now: list[float], count: int) -> list[float | None]:
    delays = []
    for _ in range(count):
        r.started("w")
        now[0] += 1.0
        delays.append(r.exited("w"))
        assert r.due() == []  # (not before its delay)
        if delays[-1] is not None:
            now[0] += delays[-1]
            assert r.due() == ["w"] and r.due() == []
    return delays


def test_quick_deaths_double_the_delay_until_a_pause_and_a_long_life_resets_it():
    """A process that keeps dying soon after its start (a stage crashed by the same bad input) pauses after
    MAX_QUICK_DEATHS, then starts again with the backoff from its start: never down for good."""
    now = [0.0]
    r = Restarts(clock=lambda: now[0])
    assert _deaths(r, now, MAX_QUICK_DEATHS + 1) == [2.0, 4.0, 8.0, 16.0, PAUSE_S, 2.0]
    r.started("w")
    now[0] += QUICK_DEATH_S + 1  # a long life: the count starts again
    assert r.exited("w") == 1.0
    given_up = Restarts(clock=lambda: now[0], give_up=True)  # (Triton's: the head exits instead)
    assert _deaths(given_up, now, MAX_QUICK_DEATHS) == [2.0, 4.0, 8.0, 16.0, None]


def test_the_head_gives_up_on_a_triton_that_keeps_dying(tmp_path, monkeypatch):
    """A Triton that died MAX_QUICK_DEATHS times in a row, each soon after its start, is not started again: the head
    says so and stops (supervise returns 1), for the supervisor above it. (The restart itself:
    tests/e2e/test_supervision.py.)"""
    from types import SimpleNamespace

    from trident.core.config import ServeSettings
    from trident.core.stagecall import directory
    from trident.supervisor import Launcher
    from trident.supervisor.triton_process import TRITON, TritonProcess

    monkeypatch.delenv(directory.ENV, raising=False)  # (the Triton workspace names its stage directory there)
    said: list[str] = []
    launcher = Launcher(ServeSettings(workspace=str(tmp_path)), out=said.append)
    launcher.triton = TritonProcess(launcher.s, launcher.workspace, launcher.token, said.append)
    launcher.workers = SimpleNamespace(live_stage_models=lambda: [])
    for _ in range(MAX_QUICK_DEATHS - 1):
        launcher.triton.restarts.started(TRITON)
        assert launcher.triton.restarts.exited(TRITON) is not None
    launcher.triton.restarts.started(TRITON)
    assert launcher._triton_back(lambda: False) is False  # (nothing started again: Triton never ran here)
    assert said == [f"[trident] Triton exited {MAX_QUICK_DEATHS} times in a row within {QUICK_DEATH_S:.0f} s of "
                    "starting; stopping everything (exit code 1)"]


def test_a_bind_model_load_that_fails_while_triton_lives_is_asked_again_then_named(tmp_path):
    """Triton 2.51 fails a python-backend model's load when the stub misses its health checks (a starved host): the
    head asks again, up to BIND_LOADS tries, each said in one line; then start-up fails naming the bind model and the
    error, with Triton's log. (Triton exiting during the load: tests/e2e/test_supervision.py.)"""
    import pytest
    from trident.core.config import ServeSettings
    from trident.supervisor import Launcher
    from trident.supervisor.head import BIND_LOADS
    from trident.supervisor.startup import StartupError

    class Triton:
        def __init__(self, failures: int):
            self.failures, self.loads = failures, 0

        def is_ready(self, name):
            return False

        def exited(self, within_s):
            return False

        def load(self, name):
            assert name == "trident_bind"
            self.loads += 1
            if self.loads <= self.failures:
                raise RuntimeError("[400] Stub process 'trident_bind_0_0' is not healthy.")

    said: list[str] = []
    launcher = Launcher(ServeSettings(workspace=str(tmp_path)), out=said.append)
    launcher.triton = Triton(failures=BIND_LOADS - 1)
    launcher._load_bind_model()
    assert launcher.triton.loads == BIND_LOADS
    assert said == ["[trident] the bind model did not load ([400] Stub process 'trident_bind_0_0' is not healthy.); "
                    "loading it again"] * (BIND_LOADS - 1)
    launcher.triton = Triton(failures=BIND_LOADS)
    with pytest.raises(StartupError, match=r"the bind model did not load \(3 tries\): \[400\] Stub process .* "
                                           r"\(Triton's log: .*triton.log\)"):
        launcher._load_bind_model()
    assert launcher.triton.loads == BIND_LOADS
