"""Token sampling of the hf engine: greedy, or temperature / top-k / top-p with a per-step seed; and the sampled
token's logprob entry, when a request asks for logprobs."""

from __future__ import annotations

import random

import torch

from trident.core.output import TokenLogprob
from trident.core.processor import SamplingParams


def new_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh one for unseeded sampling."""
    return params.seed if params.seed is not None else random.getrandbits(48)


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """Next token from one row of logits.

    Seeded sampling draws from a CPU generator seeded with ``(seed, step)``, so the same request gives the same
    tokens whether its steps run in one process or two, alone or in a batch (on a GPU the probabilities are
    computed there and drawn from on the CPU).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) & 0xFFFF_FFFF_FFFF)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def candidates(logits: torch.Tensor, token: int, top: int) -> list[TokenLogprob]:
    """The logprob entry of ``token`` sampled from one row of raw ``logits``: its own log-probability and rank,
    then the ``top`` likeliest tokens' (ranks 1..top; the sampled one is not repeated)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    own = float(logprobs[token])
    out = [TokenLogprob(token, own, int((logprobs >= logprobs[token]).sum()))]
    if top:
        values, ids = torch.topk(logprobs, top)
        out += [TokenLogprob(int(i), float(v), rank) for rank, (v, i) in enumerate(zip(values, ids), 1) if int(i) != token]
    return out
