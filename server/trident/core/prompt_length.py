"""How many tokens a prompt is once its media are expanded, measured in the BLS entry model.

E/P/D and EP/D prefill a short prompt on the decode worker (``--local-prefill-tokens``), so their entry
models measure each prompt. They use the checkpoint's ``tokenizer.json`` through the ``tokenizers`` library,
not transformers: transformers imports torch as it loads, about 3 s of CPU in each such stub at start-up, on
the cores the engines start on. The ids are the ones :class:`trident.core.processor.Processor` gives (a unit test
holds every demo model's to it); a checkpoint without a ``tokenizer.json`` falls back to the Processor.
``tokenizers`` lets other threads run only while it encodes a batch, so a prompt is encoded as a batch of one
(the BLS runs it off its event loop).

Every entry model bounds a prompt's text before any of that (:func:`text_bytes_limit`): more bytes than the
context window's tokens could hold, each as long as the longest token, cannot be served.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from trident.core.families import family_of


class PromptLength:
    """``length(text, token_counts, kinds)``: the prompt's token count with item ``i`` (of kind ``kinds[i]``)
    expanded to ``token_counts[i]`` tokens, or None where the prompt does not hold one placeholder per item
    (the stage that prefills it names the problem)."""

    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        family = model_family(path)
        expansions = [(p.text, p.expands_to) for p in family.placeholders.values() if p.expands_to is not None]

        def expand(text: str) -> str:  # (as Processor.prompt_ids writes a placeholder the processor rewrites)
            for placeholder, written in expansions:
                text = text.replace(placeholder, written)
            return text

        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            self.ids = lambda text: tokenizer.encode_batch([expand(text)], add_special_tokens=True)[0].ids
            token_id = tokenizer.token_to_id
        else:
            from trident.core.processor import Processor

            processor = Processor(path)
            self.ids = lambda text: processor.tokenizer(expand(text), add_special_tokens=True)["input_ids"]
            token_id = processor.tokenizer.convert_tokens_to_ids
        # (a kind whose placeholder only the engine expands, or whose items' text follows their timing, is not
        # measured: count() says None for its prompts)
        self.placeholder_ids = {kind: token_id(p.token) for kind, p in family.placeholders.items() if p.token and not p.timed}

    def length(self, text: str, token_counts: list[int], kinds: list[str]) -> int | None:
        return self.count(self.ids(text), token_counts, kinds)

    def count(self, ids: list[int], token_counts: list[int], kinds: list[str]) -> int | None:
        """:meth:`length` of a text already encoded (``ids``: :attr:`ids` of it)."""
        if len(token_counts) != len(kinds) or any(kind not in self.placeholder_ids for kind in kinds):
            return None
        for kind, token in self.placeholder_ids.items():
            if ids.count(token) != kinds.count(kind):
                return None
        return len(ids) - len(token_counts) + sum(token_counts)


def model_family(model_path: str | Path):
    """The checkpoint's family (:func:`trident.core.families.family_of`) from its ``config.json`` and chat template alone (no
    transformers: see the module's note)."""
    path = Path(model_path)
    config = json.loads((path / "config.json").read_bytes())
    return family_of(SimpleNamespace(model_type=config.get("model_type")), path)


def text_bytes_limit(model_path: str | Path) -> int | None:
    """The most UTF-8 bytes a prompt's text can have and still fit the model's context window: its length in tokens
    times the longest token's bytes (a token's string in the vocabulary is at least as long in UTF-8 as the text it
    stands for). None when the checkpoint has no ``tokenizer.json`` or no context length to tell it by."""
    path = Path(model_path)
    try:
        # (bytes: the python-backend stub's locale may be ASCII)
        config = json.loads((path / "config.json").read_bytes())
        vocab = json.loads((path / "tokenizer.json").read_bytes())
    except (OSError, ValueError):
        return None
    context = _context(config)
    model = vocab.get("model") or {}
    tokens = list(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else \
        [t[0] for t in model.get("vocab") or [] if isinstance(t, list) and t]
    tokens += [t.get("content", "") for t in vocab.get("added_tokens") or [] if isinstance(t, dict)]
    if not isinstance(context, int) or context <= 0 or not tokens:
        return None
    return context * max(len(t.encode("utf-8", "surrogatepass")) for t in tokens)


def context_length(model_path: str | Path) -> int | None:
    """The model's context window in tokens (its config's ``max_position_embeddings``), or None where it has none."""
    try:
        return _context(json.loads((Path(model_path) / "config.json").read_bytes()))  # (bytes: see above)
    except (OSError, ValueError):
        return None


def _context(config: dict) -> int | None:
    text = config.get("text_config") or (config.get("thinker_config") or {}).get("text_config") or {}  # (Qwen2.5-Omni: its thinker's)
    context = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return context if isinstance(context, int) and context > 0 else None
