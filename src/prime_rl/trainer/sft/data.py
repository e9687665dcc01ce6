"""SFT data: rows → token ids + completion mask → packed micro batches, in a resumable seeded order.

Row formats (per row, first match wins):
- `prompt` + `completion` strings: rendered as a user turn + an assistant turn with the chat template;
- `prompt` / `completion` as lists of messages (`{"role", "content"}`), e.g. a system + user prompt;
- `messages`: a whole conversation; every assistant turn is trained on.

Messages may carry tool calls (OpenAI format): an assistant message with `tool_calls`
(`[{"type": "function", "function": {"name", "arguments"}}]`, content may be empty or null) and
`{"role": "tool", "content": ...}` results. A row may add `tools`, a list of OpenAI function schemas (or
that list as a JSON string), which the chat template renders (`apply_chat_template(..., tools=tools)`).
The tool-call text is part of the assistant turn, so it is trained on; tool results are not.

The loss mask covers exactly the tokens the template adds for assistant turns: for each assistant turn i
it is `render(messages[:i+1])` minus `render(messages[:i], add_generation_prompt=True)`. Without a chat
template the text is `prompt + completion + eos`. Example with ChatML, prompt "ab", completion "ba":

    <|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n | ba<|im_end|>\n
    ──────────────────── mask False ───────────────────────   ── True ──
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from prime_rl.configs.sft import SFTDataConfig
from prime_rl.envs import EnvError, load_environment
from prime_rl.protocol.packing import pack_rows, pad_rows
from prime_rl.protocol.records import Sample
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.parallel import Dist, all_reduce


def load_rows(cfg: SFTDataConfig) -> tuple[list[dict], list[str]]:
    """The rows and, for each, where it came from ("data.jsonl:12") for error messages."""
    if cfg.env_id is not None:
        return _environment_rows(cfg)
    if cfg.path is not None:
        path = Path(cfg.path)
        if not path.is_file():
            raise TrainerError(f"data.path {path}: no such file")
        if path.suffix == ".jsonl":
            return _read_jsonl(path)
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # only for .parquet data

            rows = pq.read_table(path).to_pylist()
            return rows, [f"{path} row {i}" for i in range(len(rows))]
        raise TrainerError(f"data.path {path}: expected a .jsonl or .parquet file")
    import datasets  # only for hub datasets: seconds of imports that jsonl and environment rows skip

    try:
        ds = datasets.load_dataset(cfg.name, split=cfg.split)
    except Exception as e:  # datasets raises many types (network, missing split, bad name)
        raise TrainerError(f"cannot load dataset {cfg.name!r} split {cfg.split!r}: {e}") from None
    return list(ds), [f"{cfg.name}[{cfg.split}] row {i}" for i in range(len(ds))]


def _environment_rows(cfg: SFTDataConfig) -> tuple[list[dict], list[str]]:
    """`env_examples` prompts of an environment with its reference answers as the assistant's completion."""
    try:
        env = load_environment(cfg.env_id, **cfg.env_args)
        examples = list(itertools.islice(env.examples(cfg.env_seed), cfg.env_examples))
    except (EnvError, TypeError, ValueError) as e:
        raise TrainerError(f"data.env-id {cfg.env_id!r}: {e}") from None
    if missing := [i for i, ex in enumerate(examples) if not ex.answer]:
        raise TrainerError(f"data.env-id {cfg.env_id!r} gives no reference answer for example {missing[0]}")
    rows = [{"prompt": ex.prompt, "completion": ex.answer} for ex in examples]
    return rows, [f"{cfg.env_id} example {i}" for i in range(len(rows))]


def _read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    rows, where = [], []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TrainerError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TrainerError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        where.append(f"{path}:{lineno}")
    if not rows:
        raise TrainerError(f"{path}: no rows")
    return rows, where


def tokenize_row(row: dict, where: str, tokenizer: PreTrainedTokenizerBase, cfg: SFTDataConfig) -> Sample:
    """Token ids and the completion mask of one row; TrainerError naming `where` if the row is malformed."""
    return tokenize_rows([row], [where], tokenizer, cfg)[0]


def tokenize_rows(
    rows: list[dict], where: list[str], tokenizer: PreTrainedTokenizerBase, cfg: SFTDataConfig
) -> list[Sample]:
    """`tokenize_row` of each row: the chat templates render row by row, the texts encode in one batch (the
    tokenizer's per-call overhead dominated: reverse-text's 64,000 rows took 20 s one call at a time, 12 s so)."""
    plans = [_plan(row, w, tokenizer, cfg) for row, w in zip(rows, where, strict=True)]
    texts = [t for plan in plans if isinstance(plan, list) for t in plan]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    return [
        plan if isinstance(plan, Sample) else _chat_sample([next(encoded) for _ in plan], w)
        for plan, w in zip(plans, where, strict=True)
    ]


def _plan(row: dict, where: str, tokenizer: PreTrainedTokenizerBase, cfg: SFTDataConfig) -> Sample | list[str]:
    """A row without a chat template as its Sample, else the texts its loss mask is computed from."""
    tools = _tools(row.get("tools"), where)
    if tools and tokenizer.chat_template is None:
        raise TrainerError(f"{where}: tools need a tokenizer with a chat template")
    if cfg.prompt_column in row or cfg.completion_column in row:
        prompt, completion = row.get(cfg.prompt_column), row.get(cfg.completion_column)
        if prompt is None or completion is None:
            raise TrainerError(f"{where}: needs both {cfg.prompt_column!r} and {cfg.completion_column!r}")
        messages = _as_messages(prompt, "user", where) + _as_messages(completion, "assistant", where)
        if tokenizer.chat_template is None:
            return _plain(prompt, completion, tokenizer, where)
    elif cfg.messages_column in row:
        messages = _as_messages(row[cfg.messages_column], "user", where)
    else:
        raise TrainerError(
            f"{where}: no {cfg.prompt_column!r}/{cfg.completion_column!r} or {cfg.messages_column!r} column "
            f"(has {sorted(row)})"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise TrainerError(f"{where}: no assistant turn to train on")
    return _chat_texts(messages, tokenizer, tools)


# What a message keeps besides role and content: the tool-calling fields chat templates read.
_TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")


def _as_messages(value: object, role: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(
        isinstance(m, dict) and "role" in m and ("content" in m or m.get("tool_calls")) for m in value
    ):
        return [
            {"role": m["role"], "content": m.get("content")} | {k: m[k] for k in _TOOL_FIELDS if m.get(k) is not None}
            for m in value
        ]
    raise TrainerError(f"{where}: expected a string or a list of {{'role', 'content'}} messages, got {value!r:.80}")


def _tools(value: object, where: str) -> list[dict] | None:
    """The row's `tools` (OpenAI function schemas), parsed if given as a JSON string; None if absent."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise TrainerError(f"{where}: tools is a string but not valid JSON ({e.msg})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise TrainerError(f"{where}: tools must be a list of function schemas, got {value!r:.80}")
    return value or None


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool, tools: list[dict] | None
) -> str:
    # Encoded later as apply_chat_template(tokenize=True) does: the text, add_special_tokens=False.
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def _chat_texts(messages: list[dict], tokenizer: PreTrainedTokenizerBase, tools: list[dict] | None) -> list[str]:
    """For each assistant turn i: the chat before it with the generation prompt, and the chat up to it; then
    the whole chat if it goes on after the last assistant turn (else that was the last text)."""
    texts = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            texts += [
                _render(tokenizer, messages[:i], True, tools) if i else "",
                _render(tokenizer, messages[: i + 1], False, tools),
            ]
    if messages[-1]["role"] != "assistant":
        texts.append(_render(tokenizer, messages, False, tools))
    return texts


def _chat_sample(renders: list[list[int]], where: str) -> Sample:
    """The tokens of `_chat_texts`: the whole chat, its assistant turns masked in."""
    ids: list[int] = []
    mask: list[bool] = []
    paired = len(renders) // 2 * 2
    for before, upto in zip(renders[0:paired:2], renders[1:paired:2], strict=True):
        if upto[: len(ids)] != ids or upto[: len(before)] != before:
            raise TrainerError(f"{where}: the chat template does not render turns as prefixes; cannot mask them")
        mask += [False] * (len(before) - len(ids)) + [True] * (len(upto) - len(before))
        ids = upto
    full = renders[-1] if len(renders) % 2 else ids
    mask += [False] * (len(full) - len(ids))
    return Sample(list(full), mask)


def _plain(prompt: str, completion: str, tokenizer: PreTrainedTokenizerBase, where: str) -> Sample:
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise TrainerError(f"{where}: messages need a tokenizer with a chat template")
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Sample(p + c, [False] * len(p) + [True] * len(c))


def build_samples(cfg: SFTDataConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> tuple[list[Sample], int]:
    """Every row tokenized (malformed rows fail here, before training) and the number truncated to seq_len."""
    rows, where = load_rows(cfg)
    samples, truncated = [], 0
    for s in tokenize_rows(rows, where, tokenizer, cfg):
        if len(s.input_ids) > seq_len:
            s, truncated = Sample(s.input_ids[:seq_len], s.loss_mask[:seq_len]), truncated + 1
        samples.append(s)
    return samples, truncated


def epoch_order(num: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num))
    return torch.randperm(num, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def next_batch(num: int, batch_size: int, epoch: int, position: int, seed: int, shuffle: bool):
    """Indices of the next `batch_size` samples from (epoch, position), and the (epoch, position) after them.

    Example (4 samples, no shuffle): batch 3 from (0, 2) → [2, 3, 0], then (1, 1).
    """
    indices = []
    while len(indices) < batch_size:
        order = epoch_order(num, epoch, seed, shuffle)
        take = order[position : position + batch_size - len(indices)]
        indices += take
        position += len(take)
        if position >= num:
            epoch, position = epoch + 1, 0
    return indices, epoch, position


def batch_epoch(epoch: int, position: int) -> int:
    """The epoch, counted from 1, of the last sample of a batch, from the (epoch, position) `next_batch` gives
    after it: a batch that ends an epoch leaves (epoch + 1, 0), and its samples are still the epoch before's.

    Example (4 samples, batch 2): (0, 2) → 1, (1, 0) → 1, (1, 2) → 2.
    """
    return epoch if position == 0 else epoch + 1


def pack_rank_rows(mine: list[Sample], seq_len: int, dist: Dist, share_prompts: bool = False) -> list[MicroBatch]:
    """This rank's samples packed first-fit-decreasing into rows (advantages and μ unused by SFT: none, zeros in the
    rows; `share_prompts`: seq_len counts a row's shared prompt once), padded to the most rows any rank has
    (collective): FSDP's collectives need every rank to run as many forwards."""
    rows = pack_rows(mine, seq_len, temperature=1.0, share_prompts=share_prompts)
    (most,) = all_reduce([len(rows)], dist.device, op="max")
    return [MicroBatch.from_row(row) for row in pad_rows(rows, int(most), 1.0)]
