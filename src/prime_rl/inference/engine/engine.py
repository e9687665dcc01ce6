"""The built-in inference engine: one worker thread that batches concurrent requests and swaps weights.

Requests arrive from the asyncio server through `generate()`, which puts a job on a queue and awaits a
future. One background thread owns the model: it takes every waiting request (up to `max_batch_size`
sequences, after waiting `batch_wait_ms` for more), expands each request's `n` samples into rows,
left-pads the prompts, runs one prefill and then a decode loop over the whole batch with a KV cache,
and resolves each request's future when its rows are done. Rows that finish are dropped from the batch.

Weight updates are jobs on the same queue, so they run between batches on the same thread: no batch
ever mixes two policies, and a route that awaits the job knows that every later request sees the new
weights. A CPU copy of the base weights taken at startup makes `/reload_weights` exact.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prime_rl.inference.config import StartupError
from prime_rl.inference.engine.sampling import SamplingParams, sample_token, top_logprobs
from prime_rl.inference.engine.weights import load_weight_dir

logger = logging.getLogger("prime_rl")


@dataclass
class Sample:
    """One generated completion. `token_ids` include the EOS token when one ended it."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # per token; empty lists unless asked for
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"


@dataclass
class _Job:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _GenerateJob(_Job):
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _WeightsJob(_Job):
    tensors: dict[str, torch.Tensor]
    step: int


@dataclass
class _Row:
    """One sample of one request while it is being decoded."""

    job: int  # index of its request in the batch
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        device: torch.device,
        max_batch_size: int = 64,
        batch_wait_ms: float = 2.0,
        seed: int = 0,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000
        self.eos_ids = _eos_ids(model, tokenizer)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.step = 0  # weight step being served; 0 = base model
        self.batches = 0  # batches run so far (several requests share one when they arrive together)
        self.requests = 0
        self._base = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
        self._seeds = random.Random(seed)  # seeds for requests that bring none
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._held: _Job | None = None  # a job taken from the queue that did not fit the last batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="engine", daemon=True)
        self._weights_lock: asyncio.Lock | None = None

    # ---- asyncio side -------------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        """The request's `params.n` samples, generated in whatever batch the worker puts them in."""
        loop = asyncio.get_running_loop()
        job = _GenerateJob(loop, loop.create_future(), list(prompt_ids), params)
        self._queue.put(job)
        return await job.future

    async def update_weights(self, weight_dir: Path) -> int:
        """Serve the weights in a complete `weights/step_n` dir; returns n once new requests see them."""
        async with self._lock():
            loaded = await asyncio.to_thread(load_weight_dir, weight_dir, self.model)
            return await self._swap(loaded.tensors, loaded.step)

    async def reload_weights(self) -> int:
        """Serve the base weights again, bit for bit."""
        async with self._lock():
            return await self._swap(self._base, 0)

    def _lock(self) -> asyncio.Lock:
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        return self._weights_lock

    async def _swap(self, tensors: dict[str, torch.Tensor], step: int) -> int:
        loop = asyncio.get_running_loop()
        job = _WeightsJob(loop, loop.create_future(), tensors, step)
        self._queue.put(job)
        return await job.future

    # ---- worker thread ------------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stop.is_set():
            job = self._take(timeout=0.1)
            if job is None:
                continue
            if isinstance(job, _WeightsJob):
                self._run(self._load, [job])
            else:
                self._run(self._generate, self._gather(job))

    def _take(self, timeout: float) -> _Job | None:
        if self._held is not None:
            job, self._held = self._held, None
            return job
        try:
            return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _gather(self, first: _GenerateJob) -> list[_GenerateJob]:
        """`first` plus the requests that arrive within `batch_wait` and fit in `max_batch_size` rows.

        A weight job or a request that does not fit is held for the next round, so it keeps its place.
        """
        jobs, rows = [first], first.params.n
        deadline = time.monotonic() + self.batch_wait
        while rows < self.max_batch_size:
            job = self._take(timeout=deadline - time.monotonic())
            if job is None:
                break
            if isinstance(job, _WeightsJob) or rows + job.params.n > self.max_batch_size:
                self._held = job
                break
            jobs.append(job)
            rows += job.params.n
        return jobs

    def _run(self, fn, jobs: list[_Job]) -> None:
        """Run `fn(jobs)` -> one result per job and hand each result (or the error) to its awaiting route."""
        try:
            results = fn(jobs)
        except Exception as e:
            logger.exception("engine job failed")
            results = [e] * len(jobs)
        for job, result in zip(jobs, results, strict=True):
            job.loop.call_soon_threadsafe(_resolve, job.future, result)

    def _load(self, jobs: list[_WeightsJob]) -> list[int]:
        (job,) = jobs
        params = self.model.state_dict()
        with torch.no_grad():
            for name, param in params.items():
                if name in job.tensors:  # only a tied lm_head may be absent (checked when loading)
                    param.copy_(job.tensors[name])
        self.step = job.step
        logger.info(f"now serving weights step {job.step}")
        return [job.step]

    @torch.inference_mode()
    def _generate(self, jobs: list[_GenerateJob]) -> list[list[Sample]]:
        rows = [row for i, job in enumerate(jobs) for row in self._rows(i, job)]
        self.batches += 1
        self.requests += len(jobs)
        logger.debug(f"batch {self.batches}: {len(jobs)} requests, {len(rows)} rows")
        self._decode(rows)
        samples: list[list[Sample]] = [[] for _ in jobs]
        for row in rows:
            samples[row.job].append(
                Sample(row.token_ids, row.logprobs, row.top_logprobs, row.text or "", row.finish_reason or "length")
            )
        return samples

    def _rows(self, index: int, job: _GenerateJob) -> list[_Row]:
        # Sample i of a seeded request always gets the same generator, so its tokens do not depend on the
        # batch; the odd multiplier keeps (seed=1, sample 0) and (seed=0, sample 1) apart.
        seed = job.params.seed if job.params.seed is not None else self._seeds.getrandbits(62)
        return [
            _Row(index, job.prompt_ids, job.params, torch.Generator(device=self.device).manual_seed(_mix(seed, i)))
            for i in range(job.params.n)
        ]

    def _decode(self, rows: list[_Row]) -> None:
        """Prefill all rows left-padded, then decode one token per active row until every row is done."""
        from transformers import DynamicCache

        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            mask[b, width - len(row.prompt_ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = left_padded_positions(mask)
        cache = DynamicCache()
        logits = self._forward(input_ids, mask, positions, cache)
        active = list(range(len(rows)))  # rows[active[b]] is batch row b
        while True:
            tokens = [self._append(rows[r], logits[b]) for b, r in enumerate(active)]
            keep = [b for b, r in enumerate(active) if rows[r].finish_reason is None]
            if not keep:
                return
            if len(keep) < len(active):  # drop finished rows so they cost nothing more
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, positions = mask[index], positions[index]
                active = [active[b] for b in keep]
                tokens = [tokens[b] for b in keep]
            next_ids = torch.tensor(tokens, device=self.device)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            logits = self._forward(next_ids, mask, positions, cache)

    def _forward(self, input_ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _append(self, row: _Row, logits: torch.Tensor) -> int:
        """Sample the row's next token and decide whether the row is finished."""
        token, logprob, logprobs = sample_token(logits, row.params, row.generator)
        row.token_ids.append(token)
        row.logprobs.append(logprob)
        if row.params.top_logprobs > 0:
            row.top_logprobs.append(top_logprobs(logprobs, row.params.top_logprobs))
        if token in self.eos_ids:
            row.finish_reason = "stop"
        elif row.params.stop and (cut := _stop_at(self._text(row.token_ids), row.params.stop)) is not None:
            # Like vLLM: the text ends before the stop string; the token that completed it stays.
            row.text, row.finish_reason = self._text(row.token_ids)[:cut], "stop"
        elif len(row.token_ids) >= row.params.max_tokens:
            row.finish_reason = "length"
        if row.finish_reason is not None and row.text is None:
            row.text = self._text(row.token_ids)
        return token

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def left_padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token (pads get 1, they are masked anyway).

    mask [[0, 0, 1, 1], [1, 1, 1, 1]] -> [[1, 1, 0, 1], [0, 1, 2, 3]]
    """
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _mix(seed: int, sample: int) -> int:
    return (seed + sample * 0x9E3779B97F4A7C15) % 2**63


def _stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _resolve(future: asyncio.Future, result: Any) -> None:
    if future.done():  # the client went away and the route was cancelled
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def build_engine(
    model_name: str,
    device: str = "auto",
    dtype: str = "auto",
    max_batch_size: int = 64,
    batch_wait_ms: float = 2.0,
    seed: int = 0,
) -> Engine:
    """Load the model and tokenizer on `device` (auto = CUDA when present) and start the worker."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise StartupError("engine.device is cuda, but no CUDA device is available")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=getattr(torch, dtype)).to(device)
    except (OSError, ValueError) as e:  # missing path / not a model dir / hub id unreachable
        raise StartupError(f"cannot load model {model_name!r}: {e}") from None
    engine = Engine(model, tokenizer, torch.device(device), max_batch_size, batch_wait_ms, seed)
    return engine.start()
