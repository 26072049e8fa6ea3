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

Supported architectures (``ARCHS``):

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
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

ARCHS = ("llava", "qwen2vl")

# ---------------------------------------------------------------------------
# Shape constants (kept as module constants so callers / tests can use them)
# ---------------------------------------------------------------------------

#: llava: CLIP input size and patch size -> (224 // 16) ** 2 = 196 tokens/image
LLAVA_IMAGE_SIZE = 224
LLAVA_PATCH_SIZE = 16
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2  # 196

#: qwen2vl: patch 14, merge 2 -> one image token per 28x28 pixel block
QWEN_PATCH_SIZE = 14
QWEN_MERGE_SIZE = 2
QWEN_MIN_PIXELS = 4 * 28 * 28  # 3136 -> at least 4 image tokens
QWEN_MAX_PIXELS = 224 * 224  # 50176 -> at most 64 image tokens

INITIALIZER_RANGE = 0.1
TARGET_VOCAB_SIZE = 3072

RANDOM_WEIGHTS_NOTICE = "weights are RANDOM (demo model, not a trained model)"

# ---------------------------------------------------------------------------
# Fixed training corpus for the tokenizer
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Per-arch special tokens and chat templates
# ---------------------------------------------------------------------------

_LLAVA_SPECIALS = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
}
_LLAVA_EXTRA = {"image_token": "<image>"}

_QWEN_SPECIALS = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
}
_QWEN_EXTRA = {
    "im_start_token": "<|im_start|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}

LLAVA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if not loop.first %}{{ ' ' }}{% endif -%}"
    "{%- if message['role'] == 'system' -%}{{ 'SYSTEM: ' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'ASSISTANT: ' }}"
    "{%- else -%}{{ 'USER: ' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] in ['image', 'image_url'] or 'image' in item or 'image_url' in item -%}"
    "{{ '<image>\\n' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' ASSISTANT:' }}{%- endif -%}"
)

QWEN2VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] in ['image', 'image_url'] or 'image' in item or 'image_url' in item -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------


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


def _seed_everything(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _build_llava(tokenizer, seed: int):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in _token_map(tokenizer, "llava").items()}

    vision = CLIPVisionConfig(
        hidden_size=256,
        intermediate_size=1024,
        projection_dim=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_channels=3,
        image_size=LLAVA_IMAGE_SIZE,
        patch_size=LLAVA_PATCH_SIZE,
        hidden_act="quick_gelu",
        initializer_range=INITIALIZER_RANGE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,  # MHA here; the qwen2vl demo covers GQA (4 kv heads)
        max_position_embeddings=4096,
        initializer_range=INITIALIZER_RANGE,
        rms_norm_eps=1e-5,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["image"],
        image_seq_length=LLAVA_IMAGE_TOKENS,
        vision_feature_select_strategy="default",  # drop CLS -> 196 patch features
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    config.initializer_range = INITIALIZER_RANGE
    _seed_everything(seed)
    model = LlavaForConditionalGeneration(config)

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": LLAVA_IMAGE_SIZE},
        crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
        do_center_crop=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token (removed again by "default")
        image_token="<image>",
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    return model, processor


def _build_qwen2vl(tokenizer, seed: int):
    from transformers import PaddleOCRVLProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in _token_map(tokenizer, "qwen2vl").items()}
    hidden = 512
    heads = 8
    head_dim = hidden // heads  # 64 -> rotary half-dim 32 = 16 + 8 + 8
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=heads,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            initializer_range=INITIALIZER_RANGE,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
            },
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=4,
            embed_dim=128,
            hidden_size=hidden,  # output size of the patch merger = text hidden size
            mlp_ratio=4,
            num_heads=4,
            in_channels=3,
            patch_size=QWEN_PATCH_SIZE,
            spatial_merge_size=QWEN_MERGE_SIZE,
            temporal_patch_size=2,
            initializer_range=INITIALIZER_RANGE,
        ),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=False,
    )
    config.initializer_range = INITIALIZER_RANGE
    _seed_everything(seed)
    model = Qwen2VLForConditionalGeneration(config)

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS,
        patch_size=QWEN_PATCH_SIZE,
        temporal_patch_size=2,
        merge_size=QWEN_MERGE_SIZE,
    )
    # NOTE: transformers 5.x ``Qwen2VLProcessor`` has a mandatory video processor, and every
    # video processor needs torchvision (not installed here).  ``PaddleOCRVLProcessor`` is a
    # built-in, image-only processor with the exact same expansion rule
    # (``<|image_pad|>`` * grid_t*grid_h*grid_w // merge_size**2, ``tokenizer.image_token``) and it
    # returns the same tensors (input_ids, attention_mask, mm_token_type_ids, pixel_values,
    # image_grid_thw), so AutoProcessor can load it without torchvision.
    processor = PaddleOCRVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=QWEN2VL_CHAT_TEMPLATE,
    )
    return model, processor


def _token_map(tokenizer, arch: str) -> dict[str, str]:
    m = {
        "unk": tokenizer.unk_token,
        "bos": tokenizer.bos_token,
        "eos": tokenizer.eos_token,
        "pad": tokenizer.pad_token,
    }
    if arch == "llava":
        m["image"] = "<image>"
    else:
        m.update(
            im_start="<|im_start|>",
            im_end="<|im_end|>",
            vision_start="<|vision_start|>",
            vision_end="<|vision_end|>",
            image="<|image_pad|>",
            video="<|video_pad|>",
        )
    return m


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


def _legacy_vision_names(path: Path) -> None:
    """Store LLaVA's CLIP weights as ``vision_tower.vision_model.*`` (the layout of LLaVA checkpoints on the
    hub). transformers 5 saves ``vision_tower.*`` but loads both; vLLM loads only the hub layout."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {
        ("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
        for k, v in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})


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
    if arch not in ARCHS:
        raise ValueError(f"unknown demo arch {arch!r}; expected one of {ARCHS}")
    log = log or (lambda *_a, **_k: None)
    out = Path(out_dir)
    t0 = time.perf_counter()
    log(f"[demo-model] building {arch!r} demo model (seed={seed}) into {out} ...")

    import torch
    from transformers import GenerationConfig

    specials, extra = (_LLAVA_SPECIALS, _LLAVA_EXTRA) if arch == "llava" else (_QWEN_SPECIALS, _QWEN_EXTRA)
    tokenizer = _train_tokenizer(specials, extra)
    log(f"[demo-model] trained byte-level BPE tokenizer on the built-in corpus: {len(tokenizer)} tokens")

    with torch.random.fork_rng(devices=[]):  # keep the caller's RNG stream untouched
        if arch == "llava":
            model, processor = _build_llava(tokenizer, seed)
        else:
            model, processor = _build_qwen2vl(tokenizer, seed)
    model = model.to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"[demo-model] initialised {type(model).__name__} + {type(processor).__name__} "
        f"({n_params / 1e6:.1f}M random fp32 parameters, initializer_range={INITIALIZER_RANGE})"
    )

    tok_ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in _token_map(tokenizer, arch).items()}
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
        if arch == "llava":
            _legacy_vision_names(tmp / "model.safetensors")
        else:
            _write_video_processor_config(tmp)
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
    if arch == "llava":
        log(f"[demo-model] each image -> {LLAVA_IMAGE_TOKENS} <image> tokens (images are resized/cropped to 224x224)")
    else:
        log(
            "[demo-model] each image -> (H/28)*(W/28) <|image_pad|> tokens after smart-resize to "
            f"{QWEN_MIN_PIXELS}..{QWEN_MAX_PIXELS} pixels (224x224 -> 64, 300x200 -> 54)"
        )
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


def _write_video_processor_config(out: Path) -> None:
    """vLLM loads Qwen2-VL through ``Qwen2VLProcessor``, whose video processor must find its config file.
    Written as JSON because the video processor class itself needs torchvision to be created."""
    config = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS},
        "patch_size": QWEN_PATCH_SIZE,
        "temporal_patch_size": 2,
        "merge_size": QWEN_MERGE_SIZE,
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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
