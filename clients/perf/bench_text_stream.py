#!/usr/bin/env python3
"""What detokenizing costs per token as the output grows: :class:`trident.core.output.TextStream` (a window of the last
tokens decoded again) against decoding the whole output at each token, side by side on the same ids (README.md
tokenized by a demo checkpoint's tokenizer). Prints a markdown table, the one in docs/benchmarks.md's section
`Detokenizing`.

    .venv/bin/python clients/perf/bench_text_stream.py [CHECKPOINT]   (default: the Qwen2-VL demo, built if missing)
"""
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from trident.core.output import TextStream


class WholeOutput(TextStream):
    """Each token decodes every token so far."""

    def _advance(self) -> str:
        return self._decode(self._ids)


def per_token_us(cls, tok, ids) -> float:
    stream = cls(tok, ["</stop>"])
    t = time.perf_counter()
    for i in ids:
        stream.push(i)
    stream.flush()
    return (time.perf_counter() - t) / len(ids) * 1e6


def main() -> None:
    from trident.dev.demo import default_demo_model

    checkpoint = sys.argv[1] if len(sys.argv) > 1 else str(default_demo_model("qwen2vl", log=None))
    tok = AutoTokenizer.from_pretrained(checkpoint)
    ids = tok.encode((Path(__file__).parents[2] / "README.md").read_text(), add_special_tokens=False)
    print("| output tokens | whole output each token (µs/token) | TextStream (µs/token) | ratio |")
    print("|---|---|---|---|")
    for n in (500, 2000, 4000):
        whole, window = per_token_us(WholeOutput, tok, ids[:n]), per_token_us(TextStream, tok, ids[:n])
        print(f"| {n} | {whole:.0f} | {window:.0f} | {whole / window:.1f}x |")


if __name__ == "__main__":
    main()
