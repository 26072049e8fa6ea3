"""The vLLM workers' zygote (``trident.supervisor.zygote.preload`` with the vllm engine): vLLM's inspection of the
checkpoint's model class runs there, once, and fills vLLM's ``modelinfos`` cache. Before, at a machine's first start
of a model, each of a server's engines ran it in a subprocess that imported vLLM again, all at once (`trident serve
--mode all --backend vllm` of the LLaVA demo with an empty cache: ready in 43 s, now 15)."""

from __future__ import annotations

import os
import subprocess
import textwrap

from support import vllm_python

PRELOAD = """
    import os, sys
    from vllm.model_executor.models import registry

    class NoSubprocess:
        def run(self, *args, **kwargs):
            raise AssertionError("vLLM inspected the model class in a subprocess")

    registry.subprocess = NoSubprocess()
    from trident.supervisor.zygote import preload

    preload("vllm", sys.argv[1])
    info = registry.ModelRegistry._try_inspect_model_cls("LlavaForConditionalGeneration")
    print(info.supports_multimodal, sorted(os.listdir(os.path.join(os.environ["VLLM_CACHE_ROOT"], "modelinfos"))))
"""


def test_the_zygote_inspects_the_model_class_once_and_vllm_caches_what_it_found(demo_models, tmp_path):
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "vllm"))
    run = subprocess.run([vllm_python(), "-c", textwrap.dedent(PRELOAD), demo_models["llava"]], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == (
        "True ['vllm-model_executor-models-llava-LlavaForConditionalGeneration.json']")
