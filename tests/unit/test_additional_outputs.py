"""The entry interface's additional outputs in the shape of Triton's vLLM backend (its L0_additional_outputs checks),
and the hf engine's logprob entries."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import torch

from trident.worker.engines.hf.sampling import candidates
from trident.core.output import DecodeEvent, Generation, OutputOptions, TokenLogprob, entry_responses

ALL = OutputOptions(stream=True, return_finish_reason=True, return_cumulative_logprob=True, return_logprobs=True,
                    return_num_input_tokens=True, return_num_output_tokens=True)


def _entry(token: int, logprob: float) -> dict:
    return {token: {"logprob": logprob, "rank": 1, "decoded_token": f"t{token}"}}


def _responses(events: list[DecodeEvent], opts: OutputOptions, prompt: str | None = None, n: int = 1) -> list[dict]:
    async def gen():
        for e in events:
            yield e

    async def run():
        return [r async for r in entry_responses(Generation(7, gen()), opts, prompt, n)]

    return asyncio.run(run())


EVENTS = [  # the second token's text is held back (part of a character): it goes out with the third
    DecodeEvent([5], "a", None, 1, logprobs=[_entry(5, -0.5)], cumulative_logprob=-0.5),
    DecodeEvent([6], "", None, 2, logprobs=[_entry(6, -1.0)], cumulative_logprob=-1.5),
    DecodeEvent([7], "bc", None, 3, logprobs=[_entry(7, -0.25)], cumulative_logprob=-1.75),
    DecodeEvent([8], "d", "length", 4, logprobs=[_entry(8, -2.0)], cumulative_logprob=-3.75),
]


def test_every_response_carries_what_was_asked_for_its_own_tokens():
    got = _responses(EVENTS, ALL)
    assert [r["text_output"][0] for r in got] == [b"a", b"bc", b"d"]
    assert [r["finish_reason"][0] for r in got] == [b"None", b"None", b"length"]
    assert [int(r["num_output_tokens"][0]) for r in got] == [1, 2, 1]
    assert [int(r["num_input_tokens"][0]) for r in got] == [7, 7, 7]
    assert [[int(t) for e in json.loads(r["logprobs"][0]) for t in e] for r in got] == [[5], [6, 7], [8]]
    assert [float(r["cumulative_logprob"][0]) for r in got] == [-0.5, -1.75, -3.75]
    assert got[0]["cumulative_logprob"].dtype == np.float32 and got[0]["num_output_tokens"].dtype == np.uint32


def test_one_whole_response_and_nothing_unasked():
    whole = _responses(EVENTS, OutputOptions(return_num_output_tokens=True, return_logprobs=True), prompt="P:")
    assert len(whole) == 1 and whole[0]["text_output"][0] == b"P:abcd"
    assert int(whole[0]["num_output_tokens"][0]) == 4 and len(json.loads(whole[0]["logprobs"][0])) == 4
    assert set(whole[0]) == {"text_output", "num_output_tokens", "logprobs"}
    plain = [DecodeEvent([5], "a", "stop", 1)]  # logprobs not asked for in the sampling parameters
    (r,) = _responses(plain, ALL)
    assert r["logprobs"][0] == b"null" and math.isnan(float(r["cumulative_logprob"][0]))


def test_n_choices_answer_in_vectors_of_n_as_the_vllm_backend_does():
    """``n`` = 2: each response has an element per choice; a streamed one carries one choice's new text, the other's
    empty, and every choice's finish reason so far; the last response is the one where both have ended."""
    events = [
        DecodeEvent([5], "a", None, 1, index=0),
        DecodeEvent([9], "x", None, 1, index=1),
        DecodeEvent([6], "", None, 2, index=1),  # (held back: it goes out with that choice's next)
        DecodeEvent([7], "b", "stop", 2, index=0),
        DecodeEvent([8], "y", "length", 3, index=1),
    ]
    got = _responses(events, ALL, n=2)
    assert [list(r["text_output"]) for r in got] == [[b"a", b""], [b"", b"x"], [b"b", b""], [b"", b"y"]]
    assert [list(r["finish_reason"]) for r in got] == [
        [b"None", b"None"], [b"None", b"None"], [b"stop", b"None"], [b"stop", b"length"]]
    assert [[int(c) for c in r["num_output_tokens"]] for r in got] == [[1, 0], [0, 1], [1, 0], [0, 2]]
    assert all(list(r["logprobs"]) == [b"null", b"null"] and int(r["num_input_tokens"][0]) == 7 for r in got)
    (whole,) = _responses(events, OutputOptions(return_finish_reason=True, return_num_output_tokens=True),
                          prompt="P:", n=2)
    assert list(whole["text_output"]) == [b"P:ab", b"P:xy"] and list(whole["finish_reason"]) == [b"stop", b"length"]
    assert [int(c) for c in whole["num_output_tokens"]] == [2, 3]


def test_candidates_are_the_log_softmax_with_vllm_s_ranks():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0])
    want = torch.log_softmax(logits, dim=-1)
    got = candidates(logits, 2, 2)  # a sampled token outside the top two
    assert got[0] == TokenLogprob(2, float(want[2]), 3)  # two tokens are likelier
    assert [(c.token_id, c.rank) for c in got[1:]] == [(1, 1), (3, 2)] or [(c.token_id, c.rank) for c in got[1:]] == [(3, 1), (1, 2)]
    assert all(abs(c.logprob - float(want[c.token_id])) < 1e-7 for c in got)
    tied = candidates(logits, 3, 2)  # the sampled token is one of the top two: not repeated; ties share the larger rank
    assert tied[0] == TokenLogprob(3, float(want[3]), 2) and len(tied) == 2 and tied[1].token_id == 1
    assert candidates(logits, 1, 0) == [TokenLogprob(1, float(want[1]), 2)]
