"""trident.core.device: the device and dtype settings, NIXL's memory type per tensor, and one GPU per worker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trident.core.config import ServeSettings, WorkerSettings
from trident.core.device import memory_type, place, resolve_device, resolve_dtype, visible_gpus


def test_auto_is_the_cpu_in_float32_on_a_host_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: auto is CUDA here (make gpu-check holds that case)")
    device = resolve_device("auto")
    assert device == torch.device("cpu")
    assert resolve_dtype("auto", device) == torch.float32


def test_auto_dtype_is_bfloat16_on_a_gpu_and_a_named_dtype_is_kept():
    assert resolve_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cuda:0")) == torch.float16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of auto, float32, bfloat16, float16"):
        resolve_dtype("fp8", torch.device("cpu"))


def test_cuda_where_no_gpu_is_visible_is_an_error_naming_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"device 'cuda:1': this process sees no GPU \(CUDA_VISIBLE_DEVICES="):
        resolve_device("cuda:1")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "tpu:0", ""])
def test_an_unknown_device_setting_is_refused_by_the_config(bad):
    with pytest.raises(ValueError, match=f"device '{bad}' is not auto, cpu, cuda or cuda:N"):
        ServeSettings(device=bad)
    assert WorkerSettings(stage="decode", model="m", url="http://h:1", device="cuda:3").device == "cuda:3"


def test_a_tensor_s_memory_type_is_dram_on_the_cpu_and_vram_with_its_gpu():
    assert memory_type(torch.zeros(4)) == ("DRAM", 0)
    assert memory_type(SimpleNamespace(device=torch.device("cuda:1"))) == ("VRAM", 1)
    assert memory_type(SimpleNamespace(device=torch.device("cuda"))) == ("VRAM", 0)


def test_workers_get_one_gpu_each_round_robin_and_named_ones_theirs():
    names = ["encode", "prefill", "prefill-2", "decode", "decode-2"]
    assert place(names, ["0", "1"], {}, "auto") == {
        "encode": "0", "prefill": "1", "prefill-2": "0", "decode": "1", "decode-2": "0"}
    assert place(names, ["4", "5", "6"], {"decode": "6", "decode-2": "6"}, "auto") == {
        "encode": "4", "prefill": "5", "prefill-2": "6", "decode": "6", "decode-2": "6"}


def test_a_cpu_host_s_workers_keep_their_environment():
    assert place(["encode", "decode"], [], {}, "auto") == {}
    assert place(["encode", "decode"], ["0", "1"], {}, "cpu") == {}


def test_placement_errors_name_the_problem():
    with pytest.raises(ValueError, match="gpus: decode-9: no worker of this server has that name"):
        place(["encode", "decode"], ["0"], {"decode-9": "1"}, "auto")
    with pytest.raises(ValueError, match="device 'cuda': this host has no visible GPU"):
        place(["encode"], [], {}, "cuda")


def test_the_visible_gpus_are_cuda_visible_devices_when_it_is_set():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5ad1c0de"}) == ["GPU-5ad1c0de"]  # (UUIDs too)


def test_serve_hands_each_worker_its_gpu_and_the_device_settings(tmp_path):
    from trident.supervisor.worker_pool import WorkerPool

    settings = ServeSettings(model=str(tmp_path), workspace=str(tmp_path), device="cuda", dtype="float16",
                             gpus={"decode": "3"})
    pool = WorkerPool(settings, str(tmp_path), "http://127.0.0.1:8000", "127.0.0.1:8001", tmp_path / "stats",
                      tmp_path / "store", unload=lambda name: None, out=print)
    pool.gpus = place(["encode", "prefill", "decode"], ["0", "1"], settings.gpus, settings.device)
    got = {name: pool.settings_of(name) for name in ("encode", "prefill", "decode")}
    assert {name: s.cuda_visible_devices for name, s in got.items()} == {"encode": "0", "prefill": "1", "decode": "3"}
    assert {(s.device, s.dtype) for s in got.values()} == {("cuda", "float16")}
