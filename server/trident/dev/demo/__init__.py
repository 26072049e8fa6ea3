"""Tiny, deterministic, random-weight vision-language demo checkpoints.

``build_demo_model(arch, out_dir)`` writes a complete Hugging Face style
checkpoint folder (config, safetensors weights, generation config, tokenizer,
image processor, processor config and chat template) for a *small* model with
RANDOM weights.  Nothing is downloaded: the tokenizer is a byte-level BPE that
is trained on the fly on a fixed English corpus embedded in this module, and
the model weights come from ``torch.manual_seed(seed)``.

The output is byte-for-byte reproducible for a given ``(arch, seed)`` and
installed library versions, loads with ``HF_HUB_OFFLINE=1`` and does not need
torchvision (the image processors are the PIL backends).

Supported architectures (``ARCHS``), one builder module each (``llava.py``, ``qwen2vl.py``; a new
family adds its own, which defines ``BUILDER``):

* ``"llava"``   -> ``LlavaForConditionalGeneration`` (CLIP vision tower +
  Llama text model, plain multi-head attention), ``LlavaProcessor`` +
  ``CLIPImageProcessorPil``.  Every image (any size: resized + center-cropped
  to 224x224) becomes exactly 196 ``<image>`` tokens (patch 16, CLS dropped).
* ``"qwen2vl"`` -> ``Qwen2VLForConditionalGeneration`` (text uses GQA, M-RoPE),
  ``PaddleOCRVLProcessor`` + ``Qwen2VLImageProcessorPil``.  The number of
  ``<|image_pad|>`` tokens depends on the image size (224x224 -> 64,
  300x200 -> 54, at most 64, at least 4).

  Why not ``Qwen2VLProcessor``?  In transformers 5.x it *requires* a video
  processor and all video processors require torchvision, so neither
  ``AutoProcessor`` nor ``Qwen2VLProcessor.from_pretrained`` can load a
  Qwen2-VL processor without torchvision.  ``PaddleOCRVLProcessor`` is a
  built-in image-only processor whose expansion rule is identical
  (``<|image_pad|>`` x ``grid_t*grid_h*grid_w // merge_size**2``) and whose
  outputs (input_ids, attention_mask, mm_token_type_ids, pixel_values,
  image_grid_thw) are exactly what ``Qwen2VLForConditionalGeneration`` takes.
  Loading it logs a harmless one-time deprecation warning about
  ``image_processor_class``.

Load the result with::

    from transformers import AutoProcessor, AutoModelForImageTextToText
    processor = AutoProcessor.from_pretrained(out_dir)
    model = AutoModelForImageTextToText.from_pretrained(out_dir)

THE WEIGHTS ARE RANDOM: the generated text is gibberish.  These models exist
to exercise serving / batching / image-token plumbing, not to answer anything.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pkgutil
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

INITIALIZER_RANGE = 0.1
TARGET_VOCAB_SIZE = 3072

RANDOM_WEIGHTS_NOTICE = "weights are RANDOM (demo model, not a trained model)"


def rename_weights(folder: Path, old_prefix: str, new_prefix: str) -> None:
    """Rename the saved weights under ``old_prefix`` to ``new_prefix`` (to the hub's layout, which vLLM loads;
    transformers loads either)."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = load_file(path)
    renamed = {(new_prefix + k[len(old_prefix):] if k.startswith(old_prefix) else k): v for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


class ProcessorFiles:
    """A processor's files, written without the processor: transformers' processors of video models need a video
    processor, which needs torchvision (none here). Its parts (image processor, feature extractor) go in
    ``processor_config.json`` as the processor writes them, the video processor's settings in their own file."""

    def __init__(self, tokenizer, chat_template: str, processor_class: str, parts: dict, video: dict,
                 extra: dict | None = None) -> None:
        self.tokenizer, self.chat_template, self.processor_class = tokenizer, chat_template, processor_class
        self.parts, self.video, self.extra = parts, video, extra or {}

    def save_pretrained(self, folder) -> None:
        folder = Path(folder)
        self.tokenizer.save_pretrained(folder)
        (folder / "chat_template.jinja").write_text(self.chat_template)
        config = {"processor_class": self.processor_class, **{k: v.to_dict() for k, v in self.parts.items()}, **self.extra}
        (folder / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (folder / "video_preprocessor_config.json").write_text(json.dumps(self.video, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class DemoBuilder:
    """How one family's demo checkpoint is made (the family-specific half of :func:`build_demo_model`)."""

    arch: str  # the family's name (trident.core.families)
    specials: dict[str, str]  # unk/bos/eos/pad tokens
    extra: dict[str, str]  # named special tokens (image placeholder, chat roles)
    token_names: dict[str, str]  # short name -> token, for the log and the config ids
    build: Callable  # (tokenizer, token ids by short name, seed) -> (model, processor)
    after_save: Callable[[Path], None] = lambda folder: None  # adjust the saved files
    describe: str = ""  # one line on the image tokens
    added: tuple[str, ...] = ()  # plain (not special) tokens the family's tokenizer has whole, added after training
    notes: dict = field(default_factory=dict)

    def token_map(self, tokenizer) -> dict[str, str]:
        return {"unk": tokenizer.unk_token, "bos": tokenizer.bos_token, "eos": tokenizer.eos_token,
                "pad": tokenizer.pad_token, **self.token_names}


_CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
This image shows a small red house next to a tall green tree under a clear blue sky.
In the photo, two children are playing with a yellow ball on the grass near the river.
The cat is sleeping on a soft white pillow while the dog watches from the doorway.
A man in a dark coat walks along the busy street, holding an umbrella in the rain.
There is a wooden table with a bowl of apples, oranges and bananas in the kitchen.
The mountains in the background are covered with snow, and the lake below is calm.
A woman is reading a book on a bench in the park during a warm summer afternoon.
The chart shows that sales increased steadily from January to June, then fell slightly.
Describe the image in detail. What colors do you see? How many people are in the picture?
What is the person on the left doing? Is it day or night? Where was this photo taken?
The answer is yes. The answer is no. I am not sure, but it looks like a city at sunset.
Please answer the question briefly. Explain your reasoning step by step.

Once upon a time, in a quiet village at the edge of a great forest, there lived an old
baker who woke up every morning before the sun. She lit the fire in her stone oven,
mixed flour, water, salt and yeast, and shaped the dough into round loaves. By the time
the first light touched the roofs, the whole street smelled of fresh bread. Travelers
who passed through the village would stop at her shop, and she always had a kind word
and a warm roll for anyone who was hungry. Years later, people still told stories about
the baker and her bread, and about the little bell that rang whenever the door opened.

Computers process information by following instructions written in programs. A program
is a list of steps that tell the machine what to do with data. Modern processors can
execute billions of simple operations every second. Memory stores both the program and
the data it works on, while storage keeps files safe when the power is turned off.
Networks connect computers so that they can exchange messages, share resources and
cooperate on large tasks. A server waits for requests from clients and sends back
responses. When many requests arrive at the same time, the server must schedule them
fairly, batch similar work together, and avoid running out of memory.

Language models predict the next token in a sequence. A tokenizer splits text into
tokens, which are mapped to numbers called token ids. The model turns these ids into
vectors, mixes information between positions with attention, and produces a score for
every token in the vocabulary. Greedy decoding always picks the token with the highest
score, while sampling draws a token at random according to the probabilities. Vision
language models also accept images: an image encoder turns the picture into a grid of
patch features, and a projector maps those features into the same space as the text
embeddings. Special placeholder tokens mark where the image features are inserted.

The weather today is cloudy with a chance of light rain in the evening. Temperatures
will reach a high of eighteen degrees, with a gentle wind from the west. Tomorrow will
be sunny and warmer, perfect for a walk along the beach or a picnic in the garden.
Spring brings flowers and birds; summer brings long days and heat; autumn brings
falling leaves in red, orange and gold; winter brings frost, snow and short, dark days.

To make a simple soup, chop an onion, two carrots and a stalk of celery. Cook them
slowly in a little oil until soft. Add a can of tomatoes, four cups of water or stock,
a handful of lentils, and a pinch of salt and pepper. Let it simmer for thirty minutes,
stirring from time to time. Serve hot with a slice of bread and a spoonful of yogurt.

Shapes and colors: a red circle, a blue square, a green triangle, a yellow star, a
purple hexagon, an orange rectangle, a black line, a white dot, a gray cloud, a pink
heart, a brown box, a silver coin, a golden ring. The gradient goes from dark on the
left to bright on the right, and from top to bottom the hue changes smoothly.

Numbers and time: one, two, three, four, five, six, seven, eight, nine, ten, eleven,
twelve, twenty, thirty, forty, fifty, hundred, thousand, million. Monday, Tuesday,
Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April, May,
June, July, August, September, October, November, December. The meeting starts at
9:30 and ends at 11:45. The train leaves at 18:05 from platform 3. It costs $12.99.

Questions people ask: Can you help me? What does this sign say? How far is the station?
Why is the sky blue? Who painted this picture? When does the store open? Which road
leads to the harbor? How do I fix a flat tire? What is the capital of France? Paris is
the capital of France, Berlin is the capital of Germany, and Tokyo is the capital of Japan.

Science notes: water boils at one hundred degrees Celsius at sea level. Light travels
faster than sound, which is why we see lightning before we hear thunder. Plants use
sunlight, water and carbon dioxide to make sugar and release oxygen. The earth turns
around its axis once a day and travels around the sun once a year. The moon reflects
the light of the sun and changes its shape as it moves around the earth.

History notes: people have built cities, roads, bridges and ships for thousands of
years. Writing allowed them to record laws, trade, poems and memories. Printing made
books cheaper, and libraries opened their doors to more readers. Later, the telegraph,
the telephone, radio, television and the internet carried messages across the world
faster than ever before.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

{"role": "user", "content": "Hello! How are you today?"}
{"role": "assistant", "content": "I am fine, thank you. How can I help you?"}
User: What is in this image? Assistant: The image shows a cat sitting on a red chair.
User: Count the apples. Assistant: There are three apples and one pear on the plate.
User: Read the text on the sign. Assistant: The sign says "Open every day from 8 to 6".
"""


def _corpus_lines() -> list[str]:
    """The fixed training corpus, plus some deterministic generated lines."""
    lines = [ln for ln in _CORPUS.splitlines() if ln.strip()]
    words = sorted(set(_CORPUS.replace("\n", " ").split()))
    # capitalised / upper-case variants and numbers widen the merge table a bit
    lines.append(" ".join(w.capitalize() for w in words))
    lines.append(" ".join(w.upper() for w in words[::3]))
    lines.extend(f"Item {i} costs {i * 7 % 100}.{i % 10}0 and weighs {i * 13 % 1000} grams." for i in range(400))
    return lines



def _train_tokenizer(specials: dict[str, str], extra: dict[str, str]):
    """Train a deterministic byte-level BPE and wrap it as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special_list = [specials["unk_token"], specials["bos_token"], specials["eos_token"], specials["pad_token"]]
    special_list += list(extra.values())

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=special_list,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="left",
        extra_special_tokens=dict(extra),  # named: tokenizer.image_token / .image_token_id ...
        **specials,
    )
    return fast



def _quiet_progress_bars():
    """Context manager: silence transformers' tqdm bars ("Writing model shards") while saving."""
    import contextlib

    from transformers.utils import logging as hf_logging

    @contextlib.contextmanager
    def cm():
        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()

    return cm()



def build_demo_model(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    log: Callable[[str], object] | None = print,
) -> list[Path]:
    """Write a small random-weight checkpoint + tokenizer + image processor + chat template to out_dir.

    Returns the files written (sorted absolute-or-as-given paths inside ``out_dir``).
    The weights are RANDOM: the model only produces gibberish, but it has the real
    architecture, real processor and real image-placeholder expansion of ``arch``
    (one of ``ARCHS``).  The output is byte-identical for the same ``arch``/``seed``
    (and library versions).  Existing files of the same name in ``out_dir`` are
    replaced; other files there are left alone.  The caller's global torch RNG
    state is not modified.
    """
    if arch not in BUILDERS:
        raise ValueError(f"unknown demo arch {arch!r}; expected one of {ARCHS}")
    builder = BUILDERS[arch]
    log = log or (lambda *_a, **_k: None)
    out = Path(out_dir)
    t0 = time.perf_counter()
    log(f"[demo-model] building {arch!r} demo model (seed={seed}) into {out} ...")

    import torch
    from transformers import GenerationConfig

    tokenizer = _train_tokenizer(builder.specials, builder.extra)
    if builder.added:
        tokenizer.add_tokens(list(builder.added))
    log(f"[demo-model] trained byte-level BPE tokenizer on the built-in corpus: {len(tokenizer)} tokens")

    tok_ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in builder.token_map(tokenizer).items()}
    with torch.random.fork_rng(devices=[]):  # keep the caller's RNG stream untouched
        model, processor = builder.build(tokenizer, tok_ids, seed)
    model = model.to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"[demo-model] initialised {type(model).__name__} + {type(processor).__name__} "
        f"({n_params / 1e6:.1f}M random fp32 parameters, initializer_range={INITIALIZER_RANGE})"
    )

    model.generation_config = GenerationConfig(
        bos_token_id=tok_ids["bos"],
        eos_token_id=tok_ids["eos"],
        pad_token_id=tok_ids["pad"],
        do_sample=False,
    )

    # Save into a private temp folder next to out_dir, then move the files in: this tells
    # us exactly which files were written and never leaves a half-written checkpoint.
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=out))
    try:
        with _quiet_progress_bars():
            model.save_pretrained(tmp, safe_serialization=True)
            processor.save_pretrained(tmp)
        builder.after_save(tmp)
        rel_files = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
        for rel in rel_files:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            os.chmod(tmp / rel, 0o644)  # some writers use mkstemp (0600)
            os.replace(tmp / rel, out / rel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    files = [out / rel for rel in rel_files]

    dt = time.perf_counter() - t0
    log(f"[demo-model] special token ids: {json.dumps(tok_ids, sort_keys=True)}")
    log(f"[demo-model] {builder.describe}")
    for p in files:
        log(f"[demo-model]   wrote {p} ({p.stat().st_size:,} bytes)")
    log(
        f"[demo-model] done in {dt:.1f}s: {arch} demo checkpoint in {out} "
        f"({len(files)} files, {n_params:,} parameters, fp32)"
    )
    log(f"[demo-model] NOTE: {RANDOM_WEIGHTS_NOTICE}; its output is gibberish.")
    return files



def _sha256_tree(path: str | Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (relative path -> hex digest)."""
    root = Path(path)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }



DEMO_FORMAT = 3  # bump when the builder changes what it writes


def demo_model_cache() -> Path:
    """Folder the demo checkpoints are cached in (``$TRIDENT_CACHE`` or ``~/.cache/trident``)."""
    root = os.environ.get("TRIDENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trident"
    )
    return Path(root)


def default_demo_model(arch: str = "llava", log: Callable[[str], object] | None = print) -> Path:
    """The cached demo checkpoint of ``arch``, built on first use."""
    path = demo_model_cache() / f"demo-{arch}-v{DEMO_FORMAT}"
    if not (path / "config.json").is_file():
        if log:
            log(f"[demo-model] building the {arch} demo model into {path} (first use)")
        build_demo_model(arch, path, log=log)
    return path


def _discover() -> dict[str, DemoBuilder]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        builder = getattr(importlib.import_module(f"{__name__}.{info.name}"), "BUILDER", None)
        if isinstance(builder, DemoBuilder):
            found[builder.arch] = builder
    return dict(sorted(found.items()))


BUILDERS: dict[str, DemoBuilder] = _discover()
ARCHS = tuple(BUILDERS)
