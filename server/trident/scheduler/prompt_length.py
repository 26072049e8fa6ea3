"""How many tokens a prompt is once its media are expanded, measured in the BLS entry model.

E/P/D and EP/D prefill a short prompt on the decode worker (``--local-prefill-tokens``), so their entry
models measure each prompt. They use the checkpoint's ``tokenizer.json`` through the ``tokenizers`` library,
not transformers: transformers imports torch as it loads, about 3 s of CPU in each such stub at start-up, on
the cores the engines start on. The ids are the ones :class:`trident.processor.Processor` gives (a unit test
holds every demo model's to it); a checkpoint without a ``tokenizer.json`` falls back to the Processor.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from ..families import family_of


class PromptLength:
    """``length(text, token_counts, kinds)``: the prompt's token count with item ``i`` (of kind ``kinds[i]``)
    expanded to ``token_counts[i]`` tokens, or None where the prompt does not hold one placeholder per item
    (the stage that prefills it names the problem)."""

    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        config = json.loads((path / "config.json").read_text())
        family = family_of(SimpleNamespace(model_type=config.get("model_type")))
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            self._ids = lambda text: tokenizer.encode(text, add_special_tokens=True).ids
            token_id = tokenizer.token_to_id
        else:
            from ..processor import Processor

            processor = Processor(path)
            self._ids = lambda text: processor.tokenizer(text, add_special_tokens=True)["input_ids"]
            token_id = processor.tokenizer.convert_tokens_to_ids
        self.placeholder_ids = {kind: token_id(p.token) for kind, p in family.placeholders.items()}

    def length(self, text: str, token_counts: list[int], kinds: list[str]) -> int | None:
        if len(token_counts) != len(kinds) or any(kind not in self.placeholder_ids for kind in kinds):
            return None
        ids = self._ids(text)
        for kind, token in self.placeholder_ids.items():
            if ids.count(token) != kinds.count(kind):
                return None
        return len(ids) - len(token_counts) + sum(token_counts)
