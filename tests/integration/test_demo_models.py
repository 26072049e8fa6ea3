"""Tests for trident.dev.demo: tiny random-weight VLM checkpoints built offline."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Everything here must work without network access.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

from trident.dev.demo import ARCHS, RANDOM_WEIGHTS_NOTICE, build_demo_model  # noqa: E402

SERVER_DIR = Path(__file__).resolve().parents[2] / "server"

# exact number of image placeholder tokens per image, after processor expansion
EXPECTED_IMAGE_TOKENS = {
    ("llava", (224, 224)): 196,
    ("llava", (300, 200)): 196,  # resized + center-cropped to 224x224
    ("qwen2vl", (224, 224)): 64,  # grid_thw (1, 16, 16) / merge 2x2
    ("qwen2vl", (300, 200)): 54,  # smart-resize to 252x168 -> grid_thw (1, 12, 18) / 4
    ("qwen2_5vl", (224, 224)): 64,  # Qwen2.5-VL: Qwen2-VL's image processor
    ("qwen2_5vl", (300, 200)): 54,
    ("llava_next", (224, 224)): 259,  # base view 49 + 2x2 tiles of 49 + 14 row newlines
    ("llava_next", (300, 200)): 199,  # base view + 1x2 tiles (wide): the count follows the aspect
    ("gemma3", (224, 224)): 16,  # resized to 112x112: 8x8 patches pooled to 4x4
    ("gemma3", (300, 200)): 16,
    ("qwen3vl", (224, 224)): 49,  # patch 16, merge 2: smart-resize to 224x224 -> (1, 14, 14) / 4
    ("qwen3vl", (300, 200)): 54,  # -> 288x192: (1, 12, 18) / 4
}
EXPECTED_CLASSES = {
    "llava": ("LlavaForConditionalGeneration", "LlavaProcessor", "CLIPImageProcessorPil"),
    "qwen2vl": ("Qwen2VLForConditionalGeneration", "PaddleOCRVLProcessor", "Qwen2VLImageProcessorPil"),
    "qwen2_5vl": ("Qwen2_5_VLForConditionalGeneration", "PaddleOCRVLProcessor", "Qwen2VLImageProcessorPil"),
    "llava_next": ("LlavaNextForConditionalGeneration", "LlavaNextProcessor", "LlavaNextImageProcessorPil"),
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Processor", "Gemma3ImageProcessorPil"),
    "qwen3vl": ("Qwen3VLForConditionalGeneration", "PaddleOCRVLProcessor", "Qwen2VLImageProcessorPil"),
}
IMAGE_TOKEN = {"llava": "<image>", "qwen2vl": "<|image_pad|>", "qwen2_5vl": "<|image_pad|>", "llava_next": "<image>",
               "gemma3": "<image_soft_token>", "qwen3vl": "<|image_pad|>"}
VISION_ARCHS = [arch for arch in ARCHS if arch in EXPECTED_CLASSES]  # the audio demo is checked below


def gradient_image(width: int, height: int) -> "PIL_Image.Image":
    """Deterministic RGB test image: horizontal/vertical gradients."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)
    rgb = np.stack([x, y, 255.0 - 0.5 * (x + y)], axis=-1).astype(np.uint8)
    return PIL_Image.fromarray(rgb)  # HxWx3 uint8 -> RGB


def sha256_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Built:
    def __init__(self, arch, dir_a, dir_b, files_a, logs):
        self.arch = arch
        self.dir_a = dir_a
        self.dir_b = dir_b
        self.files_a = files_a
        self.logs = logs
        from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

        self.processor = AutoProcessor.from_pretrained(dir_a)
        self.tokenizer = AutoTokenizer.from_pretrained(dir_a)
        self.model = AutoModelForImageTextToText.from_pretrained(dir_a).eval()


@pytest.fixture(scope="module", params=VISION_ARCHS)
def built(request, tmp_path_factory):
    arch = request.param
    logs: list[str] = []
    dir_a = tmp_path_factory.mktemp(f"{arch}_a")
    dir_b = tmp_path_factory.mktemp(f"{arch}_b")
    files_a = build_demo_model(arch, dir_a, seed=0, log=logs.append)
    build_demo_model(arch, dir_b, seed=0, log=None)
    return Built(arch, dir_a, dir_b, files_a, logs)


def _prompt(built: Built, n_images: int, text: str = "What is in this picture?") -> str:
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    return built.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _generate(built: Built, prompt, images, tokens: int = 24):
    inputs = built.processor(text=prompt, images=images, return_tensors="pt")
    with torch.inference_mode():
        out = built.model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return inputs, out[:, inputs["input_ids"].shape[1] :]


# ---------------------------------------------------------------------------


def test_build_is_deterministic_and_reports(built):
    a, b = sha256_tree(built.dir_a), sha256_tree(built.dir_b)
    assert a == b
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(a)
    assert sorted(str(p.relative_to(built.dir_a)) for p in built.files_a) == sorted(a)
    assert all(p.is_file() for p in built.files_a)
    # human-readable log, finishing with what was written and the RANDOM notice
    assert any("model.safetensors" in line for line in built.logs)
    assert RANDOM_WEIGHTS_NOTICE in built.logs[-1]
    assert "parameters" in built.logs[-2]
    # fp32 weights, small model
    n = sum(p.numel() for p in built.model.parameters())
    assert 5_000_000 < n < 60_000_000
    assert all(p.dtype == torch.float32 for p in built.model.parameters())


def test_different_seed_changes_weights_only(built, tmp_path):
    build_demo_model(built.arch, tmp_path, seed=1, log=None)
    a, c = sha256_tree(built.dir_a), sha256_tree(tmp_path)
    assert a.keys() == c.keys()
    assert a["model.safetensors"] != c["model.safetensors"]
    assert {k for k in a if a[k] != c[k]} == {"model.safetensors"}


@pytest.fixture(scope="module")
def fresh_loads(demo_models) -> dict[str, list]:
    """What one fresh process, offline, loads from each vision demo's folder (one process for all: each costs the
    imports of torch and transformers)."""
    code = (
        "import json, sys, importlib.util\n"
        "from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer\n"
        "for d in sys.argv[1:]:\n"
        "    p = AutoProcessor.from_pretrained(d)\n"
        "    t = AutoTokenizer.from_pretrained(d)\n"
        "    m = AutoModelForImageTextToText.from_pretrained(d)\n"
        "    print(json.dumps([type(m).__name__, type(p).__name__, type(p.image_processor).__name__,"
        " importlib.util.find_spec('torchvision') is not None, len(t)]))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SERVER_DIR), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code, *(demo_models[a] for a in VISION_ARCHS)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(zip(VISION_ARCHS, (json.loads(line) for line in res.stdout.strip().splitlines()[-len(VISION_ARCHS):])))


def test_offline_load_in_fresh_process(built, fresh_loads):
    """Tokenizer, processor and model load with HF_HUB_OFFLINE=1 and without torchvision (the demo models the
    suite serves: built as this module builds them)."""
    model_cls, proc_cls, improc_cls, has_tv, vocab = fresh_loads[built.arch]
    exp_model, exp_proc, exp_improc = EXPECTED_CLASSES[built.arch]
    assert (model_cls, proc_cls) == (exp_model, exp_proc)
    if not has_tv:
        assert improc_cls == exp_improc
    assert vocab == built.model.config.get_text_config().vocab_size


def test_tokenizer_round_trip_and_special_tokens(built):
    tok = built.tokenizer
    for text in [
        "Hello, world!",
        "  leading spaces, tabs\tand\nnew lines  ",
        "Ünïcödé ✓ 日本語 emoji 🙂 and numbers 3.14159",
        "The quick brown fox jumps over the lazy dog.",
    ]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert 2000 <= len(tok) <= 4096
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) is not None
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}) == 4
    img = IMAGE_TOKEN[built.arch]
    assert tok(img, add_special_tokens=False)["input_ids"] == [built.model.config.image_token_id]
    cfg = built.model.config
    if built.arch.startswith("qwen2"):
        for t in ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]:
            assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1
        assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
        assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
        assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
        assert tok.eos_token == "<|im_end|>"
    gen = built.model.generation_config
    assert gen.eos_token_id == tok.eos_token_id
    assert gen.pad_token_id == tok.pad_token_id


def test_chat_template(built):
    p = built.processor
    msgs_str = [{"role": "user", "content": "Hi there"}]
    msgs_parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    a = p.apply_chat_template(msgs_str, add_generation_prompt=True, tokenize=False)
    b = p.apply_chat_template(msgs_parts, add_generation_prompt=True, tokenize=False)
    assert a == b
    no_gen = p.apply_chat_template(msgs_str, add_generation_prompt=False, tokenize=False)
    one_img = _prompt(built, 1, "Describe.")
    two_img = _prompt(built, 2, "Compare.")
    if built.arch in ("llava", "llava_next"):  # (LLaVA-NeXT's demo keeps LLaVA's template)
        assert a == "<s>USER: Hi there ASSISTANT:"
        assert no_gen == "<s>USER: Hi there"
        assert one_img == "<s>USER: <image>\nDescribe. ASSISTANT:"
        assert two_img.count("<image>") == 2
        conv = msgs_str + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More"}]
        assert p.apply_chat_template(conv, add_generation_prompt=True, tokenize=False) == (
            "<s>USER: Hi there ASSISTANT: Hello.</s> USER: More ASSISTANT:"
        )
    elif built.arch == "gemma3":
        assert a == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
        assert no_gen == "<bos><start_of_turn>user\nHi there<end_of_turn>\n"
        assert one_img == "<bos><start_of_turn>user\n<start_of_image>Describe.<end_of_turn>\n<start_of_turn>model\n"
        assert two_img.count("<start_of_image>") == 2
        # its processor writes each image as newlines, start, the image's tokens, end, newlines; the tokenizer has
        # the newline runs whole (as Gemma's does, and as vLLM's Gemma 3 processor requires)
        expanded = p(text=one_img, images=[gradient_image(224, 224)])["input_ids"][0]
        runs = {built.tokenizer.convert_tokens_to_ids("\n" * n): n for n in (1, 2, 3, 4)}
        start = expanded.index(built.tokenizer.convert_tokens_to_ids("<start_of_image>"))
        assert runs.get(expanded[start - 1]) == 3  # ("user\n" + "\n\n": one token of three newlines)
        assert runs.get(expanded[start + 18]) == 2 and expanded[start + 17] == built.tokenizer.convert_tokens_to_ids("<end_of_image>")
    else:
        assert a.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
        assert a.startswith("<|im_start|>system\n")
        assert not no_gen.endswith("<|im_start|>assistant\n")
        assert "<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>" in one_img
        assert two_img.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    # image parts given only by key (no "type") also count as images
    keyed = [{"role": "user", "content": [{"image": "img.png"}, {"type": "text", "text": "Describe."}]}]
    assert p.apply_chat_template(keyed, add_generation_prompt=True, tokenize=False) == one_img
    # the tokenizer carries the same template
    assert built.tokenizer.apply_chat_template(msgs_str, add_generation_prompt=True, tokenize=False) == a


@pytest.mark.parametrize("size", [(224, 224), (300, 200)], ids=["224x224", "300x200"])
def test_generate_one_image(built, size):
    prompt = _prompt(built, 1)
    inputs, new = _generate(built, prompt, [gradient_image(*size)])
    n_img = int((inputs["input_ids"] == built.model.config.image_token_id).sum())
    assert n_img == EXPECTED_IMAGE_TOKENS[(built.arch, size)]
    if built.arch.startswith("qwen2"):
        assert int(inputs["image_grid_thw"].prod(-1).sum()) // 4 == n_img
    assert new.shape == (1, 24)
    assert len(set(new[0].tolist())) > 3


def test_generate_two_images_and_text_only(built):
    prompt = _prompt(built, 2, "Compare the two pictures.")
    images = [gradient_image(224, 224), gradient_image(300, 200)]
    inputs, new = _generate(built, prompt, images)
    n_img = int((inputs["input_ids"] == built.model.config.image_token_id).sum())
    assert n_img == sum(EXPECTED_IMAGE_TOKENS[(built.arch, im.size)] for im in images)
    assert new.shape == (1, 24) and len(set(new[0].tolist())) > 3

    inputs, new = _generate(built, _prompt(built, 0, "Tell me a story."), None)
    assert int((inputs["input_ids"] == built.model.config.image_token_id).sum()) == 0
    assert new.shape == (1, 24) and len(set(new[0].tolist())) > 3
    assert isinstance(built.tokenizer.decode(new[0], skip_special_tokens=True), str)


def test_chat_template_tokenize_with_inline_image(built):
    """processor.apply_chat_template(tokenize=True) loads inline PIL images and expands them."""
    img = gradient_image(300, 200)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Hi?"}]}]
    inputs = built.processor.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(built.model.config.image_token_id) == EXPECTED_IMAGE_TOKENS[(built.arch, (300, 200))]
    assert ids.count(built.tokenizer.bos_token_id) <= 1
    with torch.inference_mode():
        out = built.model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == len(ids) + 4


def test_generate_is_deterministic_and_batch_consistent(built):
    """Greedy decode is reproducible; a left-padded batch matches unbatched runs (their first 8 tokens: fp32 and a
    tiny model, left padding should not change greedy picks, though a later one may diverge; the 8 are all that is
    generated)."""
    img = gradient_image(224, 224)
    p1 = _prompt(built, 1, "What is this?")
    p2 = _prompt(built, 1, "Please describe the colors in this image in detail.")
    _, single1 = _generate(built, p1, [img], tokens=8)
    _, again1 = _generate(built, p1, [img], tokens=8)
    assert torch.equal(single1, again1) and single1.shape == (1, 8)
    _, single2 = _generate(built, p2, [img], tokens=8)
    images = [[img], [img]] if built.arch == "gemma3" else [img, img]  # (Gemma 3's processor: a list per text)
    inputs = built.processor(text=[p1, p2], images=images, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = built.model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = out[:, inputs["input_ids"].shape[1] :]
    assert new[0].tolist() == single1[0].tolist()
    assert new[1].tolist() == single2[0].tolist()


def test_audio_demo_builds_the_same_twice_loads_offline_and_generates(tmp_path):
    """The Qwen2-Audio demo: byte-identical builds, its own processor (Whisper features, 16 kHz, 30 s window),
    ``<|AUDIO|>`` expanded to ~25 tokens a second, and greedy generation from a clip."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    assert "qwen2audio" in ARCHS
    build_demo_model("qwen2audio", tmp_path / "a", log=None)
    build_demo_model("qwen2audio", tmp_path / "b", log=None)
    assert sha256_tree(tmp_path / "a") == sha256_tree(tmp_path / "b")
    processor = AutoProcessor.from_pretrained(tmp_path / "a")
    model = Qwen2AudioForConditionalGeneration.from_pretrained(tmp_path / "a").eval()
    fe = processor.feature_extractor
    assert (type(fe).__name__, fe.sampling_rate, fe.feature_size, fe.chunk_length) == ("WhisperFeatureExtractor", 16000, 128, 30)
    content = [{"type": "audio"}, {"type": "text", "text": "What is said?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    assert "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is said?" in prompt
    wave = np.sin(np.arange(32000) / 16000 * 2 * np.pi * 300).astype(np.float32)
    inputs = processor(text=[prompt], audio=[wave], sampling_rate=16000, return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.audio_token_id).sum()) == 50  # 2 s
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(new) == 12 and len(set(new)) > 3


# (their processors need a video processor, which needs torchvision: the processor's parts load, each on its own)
PARTS_ONLY = {  # arch: (config architecture, Trident's family, its placeholder per kind as the chat template writes it)
    "qwen2_5omni": ("Qwen2_5OmniForConditionalGeneration", "qwen2_5omni",
                    ["<|vision_bos|><|IMAGE|><|vision_eos|>", "<|vision_bos|><|VIDEO|><|vision_eos|>",
                     "<|audio_bos|><|AUDIO|><|audio_eos|>"]),
    "internvl": ("InternVLForConditionalGeneration", "internvl", ["<IMG_CONTEXT>\n"]),
}


@pytest.mark.parametrize("arch", list(PARTS_ONLY))
def test_a_demo_of_a_video_processor_s_family_builds_the_same_twice_and_its_parts_load(arch, tmp_path):
    """Byte-identical builds; the hub's processor files (``processor_config.json`` with its parts, the video processor's
    settings): the tokenizer, image processor and (Omni) feature extractor load offline without torchvision, and the
    chat template writes the family's placeholders."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    from trident.core.processor import Processor

    build_demo_model(arch, tmp_path / "a", log=None)
    build_demo_model(arch, tmp_path / "b", log=None)
    assert sha256_tree(tmp_path / "a") == sha256_tree(tmp_path / "b")
    folder = tmp_path / "a"
    architecture, family, written = PARTS_ONLY[arch]
    assert AutoConfig.from_pretrained(folder).architectures == [architecture]
    processor_config = json.loads((folder / "processor_config.json").read_text())
    assert processor_config["processor_class"] == architecture.replace("ForConditionalGeneration", "Processor")
    assert "image_processor" in processor_config and (folder / "video_preprocessor_config.json").is_file()
    assert type(AutoImageProcessor.from_pretrained(folder)).__name__.endswith("Pil")
    ours = Processor(folder)
    assert ours.family.name == family and ours.family.listed
    kinds = list(ours.family.placeholders)
    content = [{"type": kind} for kind in kinds] + [{"type": "text", "text": "Hi."}]
    prompt = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    assert "".join(written) + "Hi." in prompt, prompt
