"""An embeddings record is checked against the model's embedding width before anything is read: Qwen3-VL's rows carry
their DeepStack features beside the tower's output (three hidden sizes wide in the demo), every other family's are one
hidden size wide. A record of another width is refused naming both, and its producer is told to free it (no
processes: the transfer endpoint is a stand-in that records what it is asked)."""

from __future__ import annotations

import pytest

from trident.worker.engines.handoff import receive_embeddings
from trident.core.errors import MalformedRecord
from trident.core.processor import Processor
from trident.core.protocol import EmbeddingsRecord, TensorSpec, Transfer


class _Endpoint:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def discard(self, transfer) -> None:
        self.asked.append("discard")

    def fetch(self, transfer):
        self.asked.append("fetch")
        raise RuntimeError("fetched")  # (the READ itself is not under test)


def _record(rows: int, width: int) -> EmbeddingsRecord:
    spec = TensorSpec("float32", (rows, width))
    transfer = Transfer("trident-1-abcdef12", b"m" * 64, (1 << 40, 1 << 28), ((1 << 40, spec.nbytes),), (spec,),
                        "0123456789abcdef", 2e9, 1 << 41, b"k" * 16)
    return EmbeddingsRecord(transfer=transfer, token_counts=[rows], grid_thw=[[1, 2 * rows, 2]], image_ids=["f" * 32])


@pytest.mark.parametrize("arch, width", [("qwen3vl", 3 * 512), ("qwen2vl", 512)])
def test_rows_of_another_width_are_refused_before_the_read(demo_models, arch, width):
    processor = Processor(demo_models[arch])
    assert processor.family.embedding_width(processor.config) == width
    text = "<|vision_start|><|image_pad|><|vision_end|>Describe."
    for wrong in (512 if width != 512 else 1536, width + 1):
        endpoint = _Endpoint()
        with pytest.raises(MalformedRecord, match=f"embeddings record rows are {wrong} wide; this model's are {width}"):
            receive_embeddings(endpoint, processor, text, _record(4, wrong))
        assert endpoint.asked == ["discard"]
    endpoint = _Endpoint()
    with pytest.raises(RuntimeError, match="fetched"):  # the right width goes on to the READ
        receive_embeddings(endpoint, processor, text, _record(4, width))
    assert endpoint.asked == ["fetch"]
