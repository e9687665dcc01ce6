"""The built-in inference engine: one worker thread that decodes with continuous (iteration-level) batching.

Requests arrive from the asyncio server through `generate()` / `stream()`, which put a request on a bounded
waiting queue. One background thread owns the model and repeats one *iteration*:

  1. drop the rows of cancelled requests (client gone, timed out);
  2. admit waiting requests while their `n` rows fit in `max_batch_size`: prefill their prompts together
     (left-padded, each request once, then its KV cache repeated for its `n` rows), sample each row's first
     token, and merge their KV cache into the running batch (left-padding the shorter cache); an idle engine
     first waits a few milliseconds while requests sent together keep arriving, so they are admitted together;
  3. decode one token for every running row with one forward pass over the shared KV cache;
  4. retire finished rows (EOS, stop token/string, `max_tokens`) and answer requests whose rows are all done.

So a request joins at the next iteration while others keep decoding, and rows leave as soon as they finish.
Each row has its own parameters and generator, so a seeded request draws the same tokens whatever else
shares its batch (sampling.py). A failure that belongs to one request (its prefill, its draw, its text) fails
that request alone (`RequestFailed`); only a failed decode step, shared by every row, fails the whole batch.

Weight updates are read and checked off the worker (weights.py), then handed over as a pending swap. While a
swap is pending no request is admitted; the worker copies the tensors in between two iterations, either once
the running rows have finished (`inflight="finish"`: every response is computed by one policy) or at the next
iteration (`"continue"`): then every running row's KV cache is recomputed under the new weights (its prompt
and the tokens drawn so far, prefilled again: a cache kept from the old weights would make later tokens come
from neither policy) and the same rows decode on. Each row records the weight step that sampled each of its
tokens, answered as spans (`Sample.weight_steps`, protocol/spans.py); a token's logprob is the one it was
sampled with. The route that awaits the swap knows every later request sees the new weights. A CPU copy of
the base weights taken at startup makes `/reload_weights` exact, and is what a LoRA adapter (`lora`) is merged
onto (weights.py).

This module holds the `Engine`, its asyncio API and the worker's scheduling loop. The data it takes and hands
out is in types.py, a row's stop rules and text in rows.py, what an iteration comes to for each request (its
draws, answers, deltas and failures, handed to the asyncio side) in outcomes.py, a prompt's scores
(`prompt_logprobs`, computed as a request is admitted) in scoring.py, and `build_engine` (loading a model) in
build.py.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from prime_rl.configs import LoraConfig
from prime_rl.configs.inference import EngineConfig, StartupError
from prime_rl.inference.broadcast import BroadcastReceiver
from prime_rl.inference.engine.batch import NativeBatch, TransformersBatch
from prime_rl.inference.engine.native import NativeDecoder, native_unsupported
from prime_rl.inference.engine.outcomes import fail, fail_request, post, post_deltas, record_draws, resolve, retire
from prime_rl.inference.engine.rows import Row, eos_ids
from prime_rl.inference.engine.sampling import SamplingParams
from prime_rl.inference.engine.scoring import score_prompt
from prime_rl.inference.engine.types import Delta, EngineBusy, EngineClosed, Request, Sample, Swap
from prime_rl.inference.engine.weights import (
    LoadedWeights,
    checkpoint_specs,
    load_adapter_dir,
    load_weight_dir,
    lora_targets,
    receive_weights,
)
from prime_rl.inference.weights import WeightsError

logger = logging.getLogger("prime_rl")
T = TypeVar("T")

# Multiply-adds per iteration from which a CPU engine (cpu_threads auto) uses every core; measured on 2 cores
# (tiny model at 64 rows, 1e7, ran 20% faster on one thread; hidden 256 x 4 layers at 64 rows, 2e8, 15%
# faster on two).
PARALLEL_WORK = 3e7
# An idle engine waits while requests keep arriving, each within ARRIVAL_GAP of the last (ARRIVAL_WINDOW at
# most): requests a client sends together reach the worker one by one, as the event loop parses and templates
# each, and the first admitted alone would cost the others a prefill and a decode pass of their own.
ARRIVAL_GAP, ARRIVAL_WINDOW = 0.005, 0.05


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        device: torch.device,
        config: EngineConfig | None = None,
        seed: int = 0,
        lora: LoraConfig | None = None,
    ):
        config = config or EngineConfig()  # its `device` and `dtype` were applied by whoever loaded the model
        self.model = model.eval()
        self.lora = lora  # set: weight updates are adapters, merged onto the base weights
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch_size = config.batch_rows
        self.max_waiting = config.max_waiting
        self.eos_ids = eos_ids(model, tokenizer)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.step = 0  # weight step being served; 0 = base model
        # Counters for /health and /metrics (written by the worker, read by the server).
        self.requests = 0  # requests admitted into the batch
        self.prefills = 0  # admission rounds (several requests that wait together share one prefill)
        self.iterations = 0
        self.generated_tokens = 0
        self.recomputed_rows = 0  # running rows whose cache a "continue" swap rebuilt
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) for tokens/s
        self.base_weights = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
        self.checkpoint_specs = checkpoint_specs(model)  # what a weight dir must hold (the checkpoint's layout)
        self.lora_targets = lora_targets(model, lora) if lora is not None else []
        self._seeds = random.Random(seed)  # seeds for requests that bring none
        self._waiting: collections.deque[Request] = collections.deque()
        self._swap: Swap | None = None
        self.receiver = BroadcastReceiver()
        self._wake = threading.Condition()
        self._native = _native_decoder(model, config.model_impl, config.batch_rows, self.device)
        self.model_impl = "native" if self._native is not None else "transformers"
        self._batch = self._new_batch()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="engine", daemon=True)
        self._weights_lock: asyncio.Lock | None = None
        self.cpu_threads = config.cpu_threads
        self._cores = len(os.sched_getaffinity(0))
        self._params = sum(p.numel() for p in model.parameters())  # ≈ multiply-adds per token

    def _new_batch(self) -> NativeBatch | TransformersBatch:
        if self._native is not None:
            return NativeBatch(self._native)
        return TransformersBatch(self.model, self.device, self.pad_id)

    # ---- asyncio side -------------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> int:
        return len(self._batch.rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window]
        return sum(n for _, n in recent) / window if recent else 0.0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        """The request's `params.n` samples. Cancelling the await (timeout, client gone) stops its decoding."""
        request = self._submit(prompt_ids, params, stream=False)
        try:
            samples = await request.future
        finally:
            request.cancelled = True  # no-op when it finished; otherwise the worker drops its rows
        for sample in samples:  # the prompt's scores (params.prompt_logprobs) go with every sample, as vLLM's
            sample.prompt_logprobs = request.prompt_logprobs
        return samples

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[list[Delta]]:
        """The request's deltas as they are decoded, one list per iteration; ends when every sample finished.

        The request is queued right away (so a full queue raises EngineBusy here), and read as iterated.
        """
        return self._deltas(self._submit(prompt_ids, params, stream=True))

    async def _deltas(self, request: Request) -> AsyncIterator[list[Delta]]:
        params = request.params
        try:
            finished = 0
            while finished < params.n:
                item = await request.events.get()
                if isinstance(item, BaseException):
                    raise item
                finished += sum(d.finish_reason is not None for d in item)
                yield item
        finally:
            request.cancelled = True

    def _submit(self, prompt_ids: list[int], params: SamplingParams, stream: bool) -> Request:
        if self._stop.is_set():
            raise EngineClosed("the engine is shutting down")
        if params.n > self.max_batch_size:
            raise ValueError(f"n={params.n} exceeds the engine's max_batch_size {self.max_batch_size}")
        loop = asyncio.get_running_loop()
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        events = asyncio.Queue() if stream else None
        request = Request(list(prompt_ids), params, seed, loop, loop.create_future(), events, [None] * params.n)
        with self._wake:
            if len(self._waiting) >= self.max_waiting:
                raise EngineBusy(f"{len(self._waiting)} requests are already waiting; retry later")
            self._waiting.append(request)
            self._wake.notify()
        return request

    async def update_weights(self, weight_dir: Path, inflight: str = "finish") -> int:
        """Serve the weights in a complete `weights/step_n` dir; returns n once new requests see them."""
        async with self._lock():
            loaded = await self.load_weights(weight_dir)
            return await self.swap(loaded.tensors, loaded.step, inflight)

    async def load_weights(self, weight_dir: Path) -> LoadedWeights:
        """Check and read a weight dir (an adapter, merged, with `lora`) off the event loop and the worker; the
        served weights are untouched."""
        if self.lora is not None:
            args = (weight_dir, self.model, self.lora, self.base_weights, self.lora_targets)
            return await _in_own_thread(load_adapter_dir, *args)
        return await _in_own_thread(load_weight_dir, weight_dir, self.model, self.checkpoint_specs)

    @property
    def adapter(self) -> str | None:
        """The name of the LoRA adapter merged into the served weights (None: the base, or full weights)."""
        return self.lora.name if self.lora is not None and self.step > 0 else None

    async def receive_weights(self, request) -> LoadedWeights:
        """Receive a broadcast weight step (a BroadcastRequest) off the event loop; the served weights are
        untouched."""
        if self.lora is not None:
            raise WeightsError("this server serves LoRA adapters (model.lora): send them as weight dirs")
        return await _in_own_thread(receive_weights, self.receiver, request, self.model, self.checkpoint_specs)

    async def reload_weights(self) -> int:
        """Serve the base weights again, bit for bit."""
        async with self._lock():
            return await self.swap(self.base_weights, 0)

    def _lock(self) -> asyncio.Lock:
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        return self._weights_lock

    async def swap(self, tensors: dict[str, torch.Tensor], step: int, inflight: str = "finish") -> int:
        """Serve checked tensors (`load_weight_dir`) as `step`: once the running rows have finished ("finish"),
        or at the next iteration, the running rows continuing on them ("continue")."""
        if inflight not in ("finish", "continue"):
            raise ValueError(f"inflight must be 'finish' or 'continue', got {inflight!r}")
        loop = asyncio.get_running_loop()
        swap = Swap(tensors, step, loop, loop.create_future(), inflight)
        with self._wake:
            self._swap = swap
            self._wake.notify()
        return await swap.future

    # ---- worker thread ------------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                self._iteration()
            except Exception as e:  # a failed forward fails the requests in it, not the server
                logger.exception("engine iteration failed")
                fail([row.request for row in self._batch.rows], e)
                self._batch = self._new_batch()
        fail([row.request for row in self._batch.rows] + list(self._waiting), EngineClosed("engine stopped"))

    def _iteration(self) -> None:
        self._drop_cancelled()
        if self._swap is not None and (not self._batch.rows or self._swap.inflight == "continue"):
            self._apply_swap()
            return
        if self._swap is None and not self._batch.rows:
            self._await_arrivals()
        admitted = self._admit() if self._swap is None else []
        if not admitted and not self._batch.rows:
            with self._wake:
                if not self._waiting and self._swap is None and not self._stop.is_set():
                    self._wake.wait(timeout=0.1)
            return
        if self.device.type == "cpu":
            tokens = len(self._batch.rows) + sum(len(r.prompt_ids) for r in admitted)
            threads = cpu_threads(self.cpu_threads, self._cores, tokens * self._params)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        # Counted before it runs: its requests may resolve inside it, and whoever they wake must see it counted.
        self.iterations += 1
        with torch.inference_mode():
            admitted = self._score_prompts(admitted)
            if admitted:
                self._prefill(admitted)
                self._drop_cancelled()  # a row whose request failed in the prefill has no token to decode
            if self._batch.rows:
                self._decode()

    def _drop_cancelled(self) -> None:
        with self._wake:
            if any(r.cancelled for r in self._waiting):
                self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
        rows = self._batch.rows
        if any(row.request.cancelled for row in rows):
            with torch.inference_mode():  # the cache is made of inference tensors: moving slots writes them
                self._batch.keep([b for b, row in enumerate(rows) if not row.request.cancelled])

    def _await_arrivals(self) -> None:
        """With no row running and requests waiting: wait while more arrive (ARRIVAL_GAP, ARRIVAL_WINDOW), until
        their rows fill the batch, so that requests sent together share one prefill and decode in step."""
        deadline = time.monotonic() + ARRIVAL_WINDOW
        with self._wake:
            seen = len(self._waiting)
            while seen and sum(r.params.n for r in self._waiting) < self.max_batch_size and self._swap is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set() or not self._wake.wait(min(ARRIVAL_GAP, left)):
                    return
                if len(self._waiting) == seen:  # woken by a swap or a stop
                    return
                seen = len(self._waiting)

    def _admit(self) -> list[Request]:
        admitted, room = [], self.max_batch_size - len(self._batch.rows)
        with self._wake:
            while self._waiting and self._waiting[0].params.n <= room:
                request = self._waiting.popleft()
                if not request.cancelled:
                    admitted.append(request)
                    room -= request.params.n
        return admitted

    def _prefill(self, requests: list[Request]) -> None:
        """Run the prompts of newly admitted requests, sample each row's first token, join the batch.

        A prefill shared by several requests that fails is run again per request (nothing joined the batch
        yet), so only a request whose own prefill fails is failed.
        """
        rows = [Row(r, i, random.Random(_mix(r.seed, i))) for r in requests for i in range(r.params.n)]
        start = len(self._batch.rows)
        try:
            logits = self._batch.join(requests, rows)
        except Exception as e:
            if len(requests) == 1:
                return fail_request(requests[0], e)
            for request in requests:
                self._prefill([request])
            return
        self._sample(logits, rows)
        self.requests += len(requests)
        self.prefills += 1
        retire(self._batch, range(start, start + len(rows)))

    def _score_prompts(self, requests: list[Request]) -> list[Request]:
        """Score the prompts of the admitted requests that ask (`prompt_logprobs`) before they join the batch,
        with the weights that will sample them; a request whose scoring fails is failed alone."""
        kept = []
        for request in requests:
            top = request.params.prompt_logprobs
            if top is not None:
                try:
                    params = request.params
                    request.prompt_logprobs = score_prompt(
                        self.model, request.prompt_ids, top, self.device, params.prompt_temperature, params.prompt_kept
                    )
                except Exception as e:
                    fail_request(request, e)
                    continue
            kept.append(request)
        return kept

    def _decode(self) -> None:
        logits = self._batch.step()
        self._sample(logits, self._batch.rows)
        retire(self._batch, range(len(self._batch.rows)))

    def _sample(self, logits: torch.Tensor, rows: list[Row]) -> None:
        """Draw and record each row's next token (a failure fails only its own request) and count it; a streamed
        request gets what its rows gained."""
        record_draws(logits, rows, self.eos_ids, self._text, self.step)
        self.generated_tokens += len(rows)
        now = time.monotonic()
        self._recent.append((now, len(rows)))
        while now - self._recent[0][0] > 60:
            self._recent.popleft()
        if any(row.request.events is not None for row in rows):
            post_deltas(rows, self._text)

    def _apply_swap(self) -> None:
        """Copy the pending weights in; rows still running (a "continue" swap) get their caches recomputed
        under them. A failed recompute fails those rows (`_work`), as a failed decode step does."""
        swap, params = self._swap, self.model.state_dict()
        try:
            with torch.no_grad():
                for name, param in params.items():
                    if name in swap.tensors:  # only a tied lm_head may be absent (checked when loading)
                        param.copy_(swap.tensors[name])
            self.step = swap.step
            result: Any = swap.step
        except Exception as e:  # shapes were checked, so this is an internal error; report it to the route
            logger.exception("weight swap failed")
            result = e
        self._swap = None
        post(swap.loop, resolve, swap.future, result)
        if self._batch.rows and not isinstance(result, Exception):
            with torch.inference_mode():
                self._batch.recompute()
            self.recomputed_rows += len(self._batch.rows)

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def cpu_threads(requested: int, cores: int, work: float) -> int:
    """torch threads for one CPU iteration of `work` multiply-adds: `requested`, or (0 = auto) every core for
    long iterations and every core but one for short ones. The spare core serves HTTP: on short iterations
    a pool thread preempted by the event loop stalls every parallel op more than the extra thread gains.

    cpu_threads(0, 2, 1e6) -> 1, cpu_threads(0, 2, 1e9) -> 2, cpu_threads(0, 1, 1e6) -> 1, cpu_threads(3, 16, 0) -> 3
    """
    if requested > 0:
        return requested
    return cores if work >= PARALLEL_WORK else max(1, cores - 1)


def _native_decoder(model, model_impl: str, slots: int, device: torch.device) -> NativeDecoder | None:
    """The engine's own forward for `model` (model_impl native/auto), or None to run it through transformers."""
    if model_impl == "transformers":
        return None
    reason = native_unsupported(model.config)
    if reason is None:
        return NativeDecoder(model, slots, device)
    if model_impl == "native":
        raise StartupError(f"engine.model_impl = native cannot serve this model: {reason}")
    logger.info(f"serving through transformers' forward: {reason}")
    return None


async def _in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` off the event loop and the worker, in a thread that ends with it. torch gives a thread that
    runs a parallel op an OpenMP pool of its own, kept while the thread lives; a pooled thread kept past the
    read (asyncio.to_thread's) would leave libgomp managing more threads than cores, and it then stops
    spinning between regions: the worker's decode ran ~35 % slower after the first weight update."""
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights")
    try:
        return await asyncio.wrap_future(executor.submit(fn, *args))
    finally:
        executor.shutdown(wait=False)


def _mix(seed: int, sample: int) -> int:
    # Sample i of a seeded request always gets the same generator, so its tokens do not depend on the
    # batch; the odd multiplier keeps (seed=1, sample 0) and (seed=0, sample 1) apart.
    return (seed + sample * 0x9E3779B97F4A7C15) % 2**63
