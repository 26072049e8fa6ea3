"""A checkpoint's media placeholders, read from the checkpoint itself: for a model no family adapter lists.

A prompt marks each media item with the text its chat template writes for a ``{"type": kind}`` content part (what
the OpenAI frontend renders for an image, a video or an audio part); that text from its first added token to its
last is the kind's placeholder. A kind the template writes nothing for is one the model does not take. The
token the model expands per item is the tokenizer config's ``image_token`` / ``video_token`` / ``audio_token``
(transformers writes them there) where the placeholder holds it; where it does not (Gemma 3's ``<start_of_image>``
becomes newlines, start and end tokens around ``<image_soft_token>`` s), no token: only the engine's own
processing expands that placeholder.

Only jinja2 and the checkpoint's JSON are read (no transformers, no torch): the BLS entry models and the launcher
use this as the workers do.
"""

from __future__ import annotations

import json
from pathlib import Path

MODALITIES = ("image", "video", "audio")  # (trident.core.media's, without importing it)
_MARK = "\u2063trident\u2063"  # text no template changes


def chat_template(path: Path) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja``, else ``chat_template.json``'s, else the tokenizer
    config's (its default where it names several)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "tokenizer_config.json", "processor_config.json"):
        template = _read_json(path / name).get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str):
            return template
    return None


def placeholders_of(path: str | Path) -> dict[str, tuple[str, str | None]]:
    """``{kind: (placeholder text, expanded token or None)}`` for each kind the checkpoint's chat template takes."""
    path = Path(path)
    template = chat_template(path)
    if template is None:
        return {}
    config = _read_json(path / "tokenizer_config.json")
    specials = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
    render = _compile(template)
    without = _render(render, [{"type": "text", "text": _MARK}], specials)
    if without is None:
        return {}
    vocab_specials = _added_tokens(path)
    found: dict[str, tuple[str, str | None]] = {}
    for kind in MODALITIES:
        with_item = _render(render, [{"type": kind}, {"type": "text", "text": _MARK}], specials)
        text = _special_span(_inserted(without, with_item), vocab_specials) if with_item is not None else ""
        if not text:
            continue
        token = _token_text(config.get(f"{kind}_token"))
        found[kind] = (text, token if token and token in text else None)
    return found


def _compile(template: str):
    """The template as transformers renders one (a sandbox; trimmed blocks; ``raise_exception``, ``tojson``)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "2026-01-01"
    return env.from_string(template)


def _render(compiled, content: list[dict], specials: dict) -> str | None:
    try:
        return compiled.render(messages=[{"role": "user", "content": content}], add_generation_prompt=True,
                               tools=None, documents=None, **specials)
    except Exception:  # a template that refuses the conversation takes none of it
        return None


def _inserted(before: str, after: str) -> str:
    """What ``after`` has that ``before`` has not, between their common start and end."""
    start = 0
    while start < min(len(before), len(after)) and before[start] == after[start]:
        start += 1
    end = 0
    while end < min(len(before), len(after)) - start and before[-1 - end] == after[-1 - end]:
        end += 1
    return after[start: len(after) - end]


def _special_span(text: str, specials: set[str]) -> str:
    """``text`` from its first added token to its last (a label such as "Audio 1: " around them is the template's
    wording, not the placeholder); stripped of whitespace where it holds none."""
    spans = [(i, i + len(t)) for t in specials if t for i in _find_all(text, t)]
    if not spans:
        return text.strip()
    return text[min(a for a, _ in spans): max(b for _, b in spans)]


def _find_all(text: str, sub: str):
    i = text.find(sub)
    while i >= 0:
        yield i
        i = text.find(sub, i + 1)


def _added_tokens(path: Path) -> set[str]:
    added = _read_json(path / "tokenizer.json").get("added_tokens") or []
    return {t.get("content") for t in added if isinstance(t, dict) and isinstance(t.get("content"), str)}


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # (an AddedToken's fields)
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
