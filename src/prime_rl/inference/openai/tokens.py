"""The token-in/token-out route of the built-in engine, `POST /inference/v1/generate`, in vLLM's shape (its
`scale_out/token_in_token_out` protocol, "tokens" output): a client that renders its own prompts (verifiers'
training client, through `renderers`) sends token ids and gets token ids back, never text to tokenize again.

A choice holds `token_ids`, `finish_reason`, `stop_reason` and, with `sampling_params.logprobs` set,
`logprobs.content`: per token its id and logprob, spelled both as vLLM's route does (`token_id`, `rank`,
`top_logprobs` with the sampled token first) and as `renderers` reads them (`token: "token_id:<id>"`); plus our
`weight_steps` (protocol/spans.py) and, with `sampling_params.return_sampling_mask`, each token's kept set.
Client mistakes are the same 4xx as on the OpenAI routes (serving.py checks them).
"""

from __future__ import annotations

import time
from typing import Any

from prime_rl.inference.engine import Sample
from prime_rl.inference.openai.protocol import GenerateRequest
from prime_rl.inference.openai.serving import request_id, usage_of

LOGPROB_FLOOR = -9999.0  # vLLM's for -inf (JSON has no infinities)


def token_logprob(token_id: int, logprob: float, rank: int | None = None) -> dict[str, Any]:
    return {"token_id": token_id, "token": f"token_id:{token_id}", "logprob": max(logprob, LOGPROB_FLOOR), "rank": rank}


def tokens_logprobs(sample: Sample, top: int) -> dict[str, Any]:
    """`logprobs.content` of a choice: one entry per token, its top `top` alternatives after it."""
    alternatives = sample.top_logprobs or [[]] * len(sample.token_ids)
    content = []
    for token, logprob, others in zip(sample.token_ids, sample.logprobs, alternatives, strict=True):
        ranked = [token_logprob(t, lp, k + 1) for k, (t, lp) in enumerate(others[:top])]
        rank = next((e["rank"] for e in ranked if e["token_id"] == token), None)
        entry = token_logprob(token, logprob, rank)
        content.append(entry | {"top_logprobs": [dict(entry)] + [e for e in ranked if e["token_id"] != token]})
    return {"content": content}


def generate_response(body: GenerateRequest, model: str, prompt: list[int], samples: list[Sample]) -> dict:
    """The answer to one generate request: `sampling_params.n` choices of one prompt."""
    top = body.sampling_params.logprobs
    choices = []
    for index, sample in enumerate(samples):
        choice = {"index": index, "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}
        choice |= {"token_ids": sample.token_ids, "logprobs": None if top is None else tokens_logprobs(sample, top)}
        if sample.sampling_mask:
            choice["sampling_mask"] = sample.sampling_mask
        choices.append(choice | {"weight_steps": sample.weight_steps})
    return {
        "request_id": body.request_id or request_id(),
        "model": model,
        "created": int(time.time()),
        "output_mode": "tokens",
        "usage": usage_of(len(prompt), sum(len(s.token_ids) for s in samples)),
        "prompt_token_ids": prompt if body.return_token_ids else None,  # as vLLM: only when asked for
        "choices": choices,
    }
