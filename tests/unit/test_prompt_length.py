"""The BLS's prompt measure (``tokenizers`` on the checkpoint's tokenizer.json) against the Processor's
(transformers) expanded prompt, on every demo model."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from trident.dev.demo import ARCHS
from trident.core.processor import Processor
from trident.core.prompt_length import PromptLength

TEXTS = [
    "{0}\nWhat is in the picture?",
    "  leading spaces, {0} in the middle, and a trailing newline\n",
    "Ünïcödé — 日本語のテキスト {0} émojis 🎉🎉 and tabs\tand\r\nCRLF",
    "{0}{0} two items back to back",
    "<s> a literal BOS-like string, {0}, </s> and [INST] brackets [/INST]",
    "",
]


def _cases(family):
    for template in TEXTS:
        for kind, placeholder in family.placeholders.items():
            items = template.count("{0}")
            yield template.format(placeholder.text), [7 + 3 * i for i in range(items)], [kind] * items


@pytest.mark.parametrize("arch", ARCHS)
def test_the_measure_matches_the_processors_expanded_prompt(demo_models, arch):
    processor, measure = Processor(demo_models[arch]), PromptLength(demo_models[arch])
    if not processor.family.listed:  # (no adapter expands its prompts: transformers' own processor is the reference)
        return _matches_transformers(demo_models[arch], processor, measure)
    checked = 0
    for text, counts, kinds in _cases(processor.family):
        try:
            expected = len(processor.prompt_ids(text, counts, kinds))
        except Exception:  # an empty prompt: the Processor refuses it, the stage names it
            continue
        assert measure.length(text, counts, kinds) == expected, (arch, text, counts)
        checked += 1
    assert checked >= len(TEXTS) - 1


def _matches_transformers(path, processor, measure):
    """A model no family adapter lists: each image's token count as transformers' processor expands it alone, and the
    whole prompt's length against the processor's expansion of all its images together."""
    from PIL import Image
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(path)
    images = [Image.new("RGB", size, (40 * i, 90, 200)) for i, size in enumerate([(112, 112), (300, 200), (90, 260)])]
    token = processor.token_ids["image"]
    counts = [hf(text=processor.family.placeholders["image"].text, images=[im])["input_ids"][0].count(token) for im in images]
    assert len(set(counts)) == 3, counts  # (the demo's count follows the image's size)
    checked = 0
    for template in TEXTS:
        items = template.count("{0}")
        text = template.format(processor.family.placeholders["image"].text)
        if not text.strip():
            continue
        expected = len(hf(text=text, images=images[:items] or None)["input_ids"][0])
        assert measure.length(text, counts[:items], ["image"] * items) == expected, text
        checked += 1
    assert checked >= len(TEXTS) - 1


@pytest.mark.parametrize("arch", ["llava", "qwen2vl"])
def test_a_prompt_without_one_placeholder_per_item_is_not_measured(demo_models, arch):
    measure = PromptLength(demo_models[arch])
    text = Processor(demo_models[arch]).family.placeholders["image"].text
    assert measure.length(f"{text}\nhi", [5, 5], ["image", "image"]) is None  # one placeholder, two items
    assert measure.length(f"{text}{text}\nhi", [5], ["image"]) is None  # two placeholders, one item
    assert measure.length("hi", [5], ["audio"]) is None  # a kind the family does not take
    assert measure.length(f"{text}\nhi", [5, 6], ["image"]) is None  # counts and kinds disagree
    assert measure.length(f"{text}\nhi", [5], ["image"]) is not None


def test_a_checkpoint_without_tokenizer_json_is_measured_by_the_processor(demo_models, tmp_path, monkeypatch):
    import trident.core.processor

    folder = tmp_path / "llava"
    shutil.copytree(demo_models["llava"], folder)
    (folder / "tokenizer.json").unlink()
    # transformers here cannot load a tokenizer without tokenizer.json (no sentencepiece): the fallback gets the
    # original checkpoint's Processor, and must be the path taken
    loaded = []
    monkeypatch.setattr(trident.core.processor, "Processor", lambda path: loaded.append(path) or Processor(demo_models["llava"]))
    text = "<image>\nWhat is this?"
    assert PromptLength(folder).length(text, [9], ["image"]) == len(Processor(demo_models["llava"]).prompt_ids(text, [9], ["image"]))
    assert loaded == [folder]


def test_measuring_does_not_import_transformers_or_torch(demo_models):
    code = (
        "import sys; from trident.core.prompt_length import PromptLength; "
        f"m = PromptLength({demo_models['llava']!r}); assert m.length('<image> hi', [4], ['image']) > 4; "
        "print(sorted(k for k in ('torch', 'transformers') if k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("arch", ["llava", "qwen2vl"])
def test_the_text_bytes_limit_holds_a_context_window_of_the_longest_tokens(demo_models, arch):
    """No text that fits the context window is over the limit: not even one made of the longest token only."""
    from transformers import AutoTokenizer

    from trident.core.prompt_length import text_bytes_limit

    tok, limit = AutoTokenizer.from_pretrained(demo_models[arch]), text_bytes_limit(demo_models[arch])
    context = Processor(demo_models[arch]).max_model_len
    longest = max(range(len(tok)), key=lambda i: len(tok.decode([i]).encode()))
    widest = tok.decode([longest] * context).encode()
    assert len(widest) <= limit < 4 * len(widest)
