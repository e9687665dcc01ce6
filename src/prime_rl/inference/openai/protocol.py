"""The OpenAI request models of the built-in engine, and the error a request is answered with.

Unknown fields are ignored, as vLLM does; known ones the engine does not implement are refused (400) unless
they hold the value that means "off", since anything else would change what the caller samples.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

MAX_TOP_LOGPROBS = 20

# Parameters the built-in engine does not implement, with the value that means "off".
UNSUPPORTED = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "best_of": 1,
    "echo": False,
    "tools": None,
    "response_format": None,
    "include_stop_str_in_output": False,
    "prompt_logprobs": None,  # declared by completions (CompletionRequest); chat does not score prompts
}


# Counts the engine turns into tensor sizes and indices: a larger one overflowed inside a batch and failed every
# request batched with it, so it is refused here, with a 400 for its own request only.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed's range (vLLM's)
# The engine samples in float32: a larger repetition penalty is inf there, and inf x 0 a NaN logit.
FLOAT32_MAX = 3.4e38


class APIError(Exception):
    """A request answered with an OpenAI-style error body: `status`, `message` and the error `type`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type


class SamplingFields(BaseModel):
    """The sampling parameters every generation route takes (vLLM's names and ranges)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    n: Annotated[int, Field(ge=1)] = 1
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    temperature: Annotated[float | None, Field(ge=0, le=2)] = None  # OpenAI's and vLLM's range
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    top_k: Annotated[int | None, Field(ge=-1, le=INT32_MAX)] = None  # beyond any vocabulary: no filter
    min_p: Annotated[float | None, Field(ge=0, le=1)] = None
    repetition_penalty: Annotated[float | None, Field(gt=0, le=FLOAT32_MAX)] = None
    seed: Annotated[int | None, Field(ge=INT64_MIN, le=INT64_MAX)] = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # Each token also carries its kept set (`sampling_mask`: sorted ids, [] = nothing filtered) and a logprob
    # renormalised over it: what RL with top-p / top-k replays in the trainer.
    return_sampling_mask: bool = False

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in (None, UNSUPPORTED[name]):
                raise ValueError(f"{name}={value!r} is not supported by the built-in engine")
        return self


class SamplingRequest(SamplingFields):
    """What completions and chat requests share: the model name, sampling and the vLLM extras."""

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    # vLLM's extra: each choice also carries the logprob of every prompt token given its prefix (serving.py)
    prompt_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    # Our extension (distillation: a teacher scores the student's tokens under the distribution they were drawn
    # from, engine/scoring.py): prompt logprobs at this temperature, and at each position named (position in the
    # prompt -> token ids) renormalised over that kept set. vLLM has neither and ignores unknown fields, so the
    # answer echoes the temperature on each choice: a client that sees no echo knows it was not applied.
    prompt_logprobs_temperature: Annotated[float | None, Field(gt=0, le=2)] = None
    prompt_logprobs_kept: dict[int, Annotated[list[int], Field(min_length=1)]] | None = None

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> CompletionRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream=true")
        extension = self.prompt_logprobs_temperature is not None or self.prompt_logprobs_kept is not None
        if extension and self.prompt_logprobs is None:
            raise ValueError("prompt_logprobs_temperature and prompt_logprobs_kept need prompt_logprobs")
        return self


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, rendered by the chat template as given
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: Annotated[str, Field(min_length=1)]
    arguments: str | dict[str, Any] = ""

    @field_validator("arguments")
    @classmethod
    def _arguments_object(cls, value: str | dict[str, Any]) -> dict[str, Any]:
        """OpenAI sends the arguments as a JSON string; templates expect the object (as vLLM passes them)."""
        if isinstance(value, dict):
            return value
        if not value:
            return {}
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("function.arguments must be a JSON object (as a string)") from None
        if not isinstance(parsed, dict):
            raise ValueError("function.arguments must be a JSON object (as a string)")
        return parsed


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ...: passed to the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the id of the call it answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the tool call it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool] | None, Field(min_length=1)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # unset = auto with tools
    parallel_tool_calls: bool | None = None  # False keeps only the first call of a turn (as vLLM)


class GenerateSampling(SamplingFields):
    """`sampling_params` of a token-in/token-out request, as vLLM's SamplingParams names them. Decoding
    options are accepted and have no effect: the route answers with token ids only."""

    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None  # None: none; k: the sampled + top k
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class GenerateRequest(BaseModel):
    """A body of `POST /inference/v1/generate` (vLLM's token-in/token-out route, its text-only subset): the
    prompt as token ids, answered with token ids. Multimodal fields, text output and streaming are refused
    by name: the built-in engine has none of them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    request_id: str | None = None
    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    sampling_params: GenerateSampling  # required, as by vLLM
    model: str | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: bool | None = False
    return_token_ids: bool | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerateRequest:
        if self.stream:
            raise ValueError("stream=true: the built-in engine answers this route whole (stream /v1/completions)")
        for name in ("features", "content_parts", "kv_transfer_params", "ec_transfer_params"):
            if (self.model_extra or {}).get(name) is not None:
                raise ValueError(f"{name} is not supported by the built-in engine (text token ids only)")
        return self


def context_overflow(max_model_len: int, prompt_len: int, max_tokens: int) -> str | None:
    """Why a prompt and the tokens asked for do not fit the context (vLLM's words), else None."""
    if prompt_len + max_tokens <= max_model_len and prompt_len < max_model_len:
        return None
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion)."
    )


def generate_problem(body: dict[str, Any], max_model_len: int) -> str | None:
    """What the built-in engine would refuse in a /inference/v1/generate body that vLLM serves anyway: more
    tokens asked for than the context holds (vLLM stops at its end instead). Other fields are left to vLLM."""
    ids, params = body.get("token_ids"), body.get("sampling_params")
    max_tokens = params.get("max_tokens") if isinstance(params, dict) else None
    if not isinstance(ids, list) or not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        return None
    return context_overflow(max_model_len, len(ids), max_tokens)


def describe(error: RequestValidationError | ValidationError, where: tuple = ()) -> str:
    """One readable line per problem, e.g. `body.n: Input should be greater than or equal to 1`; `where` is
    prepended to the locations of a pydantic error (a request's are `body....` already)."""
    problems = []
    for e in error.errors():
        loc = ".".join(str(part) for part in (*where, *e.get("loc", ())))
        problems.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "invalid request: " + "; ".join(problems)[:2000]


CHAT_MESSAGES = TypeAdapter(list[ChatMessage])


def chat_messages_problem(body: dict[str, Any]) -> str | None:
    """What the built-in engine would refuse in a chat body's `messages` (a tool message without the id of the
    call it answers, tool calls on a non-assistant turn, call arguments that are no JSON object), else None.

    The vLLM backend checks these too (vLLM accepts them), so a conversation is valid on both or on neither.
    Messages that are not a list are left to the backend's own validation.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    try:
        CHAT_MESSAGES.validate_python(messages)
    except ValidationError as e:
        return describe(e, ("body", "messages"))
    return None
