"""The OpenAI frontend renders chat templates with the checkpoint's tokenizer loaded without torch
(:func:`trident.frontend.app.chat_tokenizer`): every demo family's prompt equals ``AutoTokenizer``'s, media, a
system turn, earlier turns and tools alike, and the frontend's module and tokenizer leave torch unimported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trident.dev.demo import ARCHS

CONVERSATIONS = {
    "text": [{"role": "user", "content": [{"type": "text", "text": "Hi."}]}],
    "system-image": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
    "turns": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Two"}]},
              {"role": "assistant", "content": "A cat and a dog."}, {"role": "user", "content": "And now?"}],
    "video": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
    "audio": [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is said?"}]}],
}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _render(tokenizer, conversation, tools):
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # (a template may refuse a kind it does not take: both must refuse it alike)
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_frontend_renders_what_auto_tokenizer_renders(demo_models, arch):
    from transformers import AutoTokenizer

    from trident.frontend.app import chat_tokenizer

    ours, auto = chat_tokenizer(demo_models[arch]), AutoTokenizer.from_pretrained(demo_models[arch])
    assert ours.special_tokens_map == auto.special_tokens_map
    rendered = 0
    for name, conversation in CONVERSATIONS.items():
        for tools in (None, TOOLS):
            got, want = _render(ours, conversation, tools), _render(auto, conversation, tools)
            assert got == want, (name, tools is not None)
            rendered += "<" in got or "\n" in got  # (a template's markup, not an error)
    assert rendered >= 2, "no conversation rendered"


def test_the_frontend_starts_without_torch(demo_models):
    code = ("import sys; from trident.frontend.app import chat_tokenizer; "
            f"t = chat_tokenizer({demo_models['qwen2vl']!r}); "
            "assert t.apply_chat_template([{'role': 'user', 'content': 'Hi'}], tokenize=False); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[-500:]
