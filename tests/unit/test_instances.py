"""The BLS's view of the live stage instances (:mod:`trident.in_triton.scheduler.instances`): instances that come and go,
joined ones found past the highest name seen, and a gone one forgotten by the router and held out for a moment
though Triton still shows it ready (its worker restarting under the same entry)."""

from __future__ import annotations

from trident.in_triton.scheduler.instances import GONE_HOLD_S, Instances


def test_instances_come_and_go(tmp_path):
    (tmp_path / "prefill").mkdir()
    (tmp_path / "prefill-2").mkdir()
    (tmp_path / "e_p_d").mkdir()  # not a stage instance: never probed
    ready = {"prefill", "prefill-2", "prefill-4", "decode"}
    probed, forgotten, lines = [], [], []

    def is_ready(name: str) -> bool:
        probed.append(name)
        return name in ready

    now = [0.0]
    live = Instances(["prefill", "decode"], tmp_path, is_ready, 60.0, forgotten.append, lines.append,
                     clock=lambda: now[0])
    live.refresh(force=True)
    assert live.live == {"prefill": ["prefill", "prefill-2", "prefill-4"], "decode": ["decode"]}  # -4: joined
    assert "e_p_d" not in probed and live.stages() == {"prefill", "decode"}
    ready.discard("prefill-2")
    live.refresh()  # within refresh_s: not looked at again
    assert "prefill-2" in live.live["prefill"]
    live.refresh(force=True)
    assert live.live["prefill"] == ["prefill", "prefill-4"] and forgotten == ["prefill-2"]
    live.mark_gone("decode")
    assert live.stages() == {"prefill"} and forgotten == ["prefill-2", "decode"]
    assert "stage instance prefill-2 is gone" in lines
    live.refresh(force=True)  # a planned-again request looks at once: still ready in Triton, but held out
    assert live.live["decode"] == []
    now[0] += GONE_HOLD_S
    live.refresh(force=True)
    assert live.live["decode"] == ["decode"]
