"""The start-up gate: ``/v2/health/ready`` says not ready from the moment Triton listens until the entry models are
loaded.

Triton's strict readiness counts a model that failed to load against the server until it is unloaded, and Triton
unloads only a model that loaded. The gate is a model put in Triton's start-up repository that fails to load at
once (its backend does not exist, so nothing starts); :func:`open_gate` loads it again as an ensemble over a loaded
entry model (nothing starts either), then unloads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

GATE = "trident_starting"
GATE_CONFIG = f"""name: "{GATE}"
backend: "{GATE}"
max_batch_size: 0
input [{{ name: "x" data_type: TYPE_BOOL dims: [1] }}]
output [{{ name: "y" data_type: TYPE_BOOL dims: [1] }}]
"""


def _as_ensemble(entry: str) -> dict:
    """The start-up gate as a model that loads: an ensemble over a loaded entry model."""
    return {
        "name": GATE, "platform": "ensemble",
        "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}],
        "ensemble_scheduling": {"step": [{"model_name": entry, "model_version": -1,
                                          "input_map": {"text_input": "text_input"},
                                          "output_map": {"text_output": "text_output"}}]},
    }



def close_gate(model_store: Path) -> None:
    """Put the gate in Triton's start-up repository (before Triton starts)."""
    folder = model_store / GATE
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(GATE_CONFIG)


def open_gate(client, headers: dict, model_store: Path, through: str | None, out) -> None:
    """Let readiness through: the gate loaded as an ensemble over the loaded entry model ``through``, then unloaded
    (``client``: a tritonclient HTTP client; ``out``: where a failure is said)."""
    try:
        if through is not None:
            client.load_model(GATE, config=json.dumps(_as_ensemble(through)), headers=headers)
        client.unload_model(GATE, headers=headers)
    except Exception as e:  # noqa: BLE001 - the server stays not READY: say so, do not stop serving
        out(f"[trident] could not open the start-up gate ({e}); /v2/health/ready stays not ready")
    shutil.rmtree(model_store / GATE, ignore_errors=True)
