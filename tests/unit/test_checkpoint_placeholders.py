"""A checkpoint's placeholders read from its chat template (``trident.core.families.checkpoint``): for every demo whose
family an adapter lists they equal the adapter's declared ones (the token too, where the placeholder is that token
expanded; Gemma 3's placeholder is rewritten around its token, which the template cannot tell); for a demo none lists
they are what the model's processor expands."""

from __future__ import annotations

import pytest

from trident.dev.demo import ARCHS
from trident.core.families import FAMILIES, Unlisted, family_of
from trident.core.families.checkpoint import placeholders_of


@pytest.mark.parametrize("arch", [a for a in ARCHS if a in FAMILIES])
def test_the_template_gives_each_listed_family_s_declared_placeholders(demo_models, arch):
    declared = {kind: (p.text, None if p.expands_to else p.token) for kind, p in FAMILIES[arch].placeholders.items()}
    assert placeholders_of(demo_models[arch]) == declared


def test_an_unlisted_model_s_placeholders_and_its_expanded_token(demo_models):
    from types import SimpleNamespace

    assert placeholders_of(demo_models["llava_next"]) == {"image": ("<image>", "<image>")}
    family = family_of(SimpleNamespace(model_type="llava_next"), demo_models["llava_next"])
    assert isinstance(family, Unlisted) and family.modalities == ("image",)
    with pytest.raises(ValueError, match="no family adapter for model type 'llava_next'.*backend: vllm"):
        family.load_model()


def test_a_template_that_marks_no_media_is_refused_naming_it(demo_models, tmp_path):
    import shutil
    from types import SimpleNamespace

    folder = tmp_path / "text-only"
    shutil.copytree(demo_models["llava_next"], folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] if m['content'] is string "
                                                "else '' }}{% endfor %}")
    assert placeholders_of(folder) == {}
    with pytest.raises(ValueError, match="marks no image, video or audio part"):
        family_of(SimpleNamespace(model_type="llava_next"), folder)
