"""When a supervised process starts again (launcher/restarts.py), on a clock the test moves."""

from trident.launcher.restarts import MAX_QUICK_DEATHS, QUICK_DEATH_S, Restarts


def test_quick_deaths_double_the_delay_until_the_process_is_left_down_and_a_long_life_resets_it():
    now = [0.0]
    r = Restarts(clock=lambda: now[0])
    delays = []
    for _ in range(MAX_QUICK_DEATHS):
        r.started("w")
        now[0] += 1.0
        delays.append(r.exited("w"))
        assert r.due() == []  # (not before its delay)
        if delays[-1] is not None:
            now[0] += delays[-1]
            assert r.due() == ["w"] and r.due() == []
    assert delays == [2.0, 4.0, 8.0, 16.0, None]
    r.started("w")
    now[0] += QUICK_DEATH_S + 1  # a long life: the count starts again
    assert r.exited("w") == 1.0
