"""SFT data: completion-only masks with the chat template (tool calls included), malformed rows named by file:line,
batch order."""

import functools
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prime_rl.configs.sft import SFTDataConfig
from prime_rl.protocol.packing import first_fit_decreasing
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.sft.data import build_samples, next_batch, tokenize_row


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _masked_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])


def test_prompt_completion_row_trains_only_on_the_assistant_turn(tokenizer):
    cfg = SFTDataConfig(path="x.jsonl")
    sample = tokenize_row({"prompt": "abc", "completion": "cba"}, "x.jsonl:1", tokenizer, cfg)
    assert _masked_text(tokenizer, sample) == "cba<|im_end|>\n"
    assert tokenizer.decode(sample.input_ids).startswith("<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n")


def test_messages_row_trains_on_every_assistant_turn_and_nothing_else(tokenizer):
    cfg = SFTDataConfig(path="x.jsonl")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
                {"role": "assistant", "content": "ok"}]  # fmt: skip
    sample = tokenize_row({"messages": messages}, "x.jsonl:1", tokenizer, cfg)
    assert _masked_text(tokenizer, sample) == "yo<|im_end|>\nok<|im_end|>\n"
    assert len(sample.input_ids) == len(sample.loss_mask)


def test_rows_encoded_in_one_batch_are_the_templates_tokens_with_each_rows_own_mask(tmp_path, tokenizer):
    """build_samples renders every row, then encodes all texts at once: each sample is still exactly
    apply_chat_template(tokenize=True) of its chat, whatever its shape (a trailing user turn, no prompt)."""
    chats = [
        [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
         {"role": "user", "content": "and then?"}],
        [{"role": "assistant", "content": "first"}, {"role": "user", "content": "x"},
         {"role": "assistant", "content": "second"}],
    ]  # fmt: skip
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    samples, _ = build_samples(SFTDataConfig(path=path), tokenizer, 512)
    for sample, chat in zip(samples, chats, strict=True):
        assert sample.input_ids == list(tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"])
    # A chat that opens with the assistant has no prompt to tell that turn's header from: it is trained on.
    assert [_masked_text(tokenizer, s) for s in samples] == [
        "cba<|im_end|>\n", "yo<|im_end|>\n", "<|im_start|>assistant\nfirst<|im_end|>\nsecond<|im_end|>\n"
    ]  # fmt: skip


def test_malformed_rows_are_reported_with_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n\n" + "{not json\n")
    with pytest.raises(TrainerError, match=r"data.jsonl:3: not valid JSON"):
        build_samples(SFTDataConfig(path=path), tokenizer, 64)
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(TrainerError, match=r"data.jsonl:2: needs both 'prompt' and 'completion'"):
        build_samples(SFTDataConfig(path=path), tokenizer, 64)
    path.write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(TrainerError, match=r"data.jsonl:1: no 'prompt'/'completion' or 'messages' column"):
        build_samples(SFTDataConfig(path=path), tokenizer, 64)


def test_parquet_rows_and_truncation(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "ab", "completion": "ba"}, {"prompt": "x" * 200, "completion": "y"}]), path
    )
    samples, truncated = build_samples(SFTDataConfig(path=path), tokenizer, 32)
    assert len(samples) == 2 and truncated == 1 and len(samples[1].input_ids) == 32


def test_next_batch_wraps_into_the_next_epoch():
    assert next_batch(4, 3, epoch=0, position=2, seed=0, shuffle=False) == ([2, 3, 0], 1, 1)
    first, _, _ = next_batch(10, 10, 0, 0, seed=0, shuffle=True)
    second, _, _ = next_batch(10, 10, 1, 0, seed=0, shuffle=True)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second  # reshuffled per epoch


def test_first_fit_decreasing_example():
    assert first_fit_decreasing([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="does not fit seq_len 8"):
        first_fit_decreasing([9], 8)


def test_rows_from_an_environment_are_its_prompts_with_their_reference_answers():
    from prime_rl.trainer.sft.data import load_rows

    cfg = SFTDataConfig(env_id="reverse-text", env_args={"min_chars": 4, "max_chars": 8}, env_examples=5, env_seed=3)
    rows, where = load_rows(cfg)
    assert len(rows) == 5 and where[0] == "reverse-text example 0"
    for row in rows:
        assert row["completion"] == row["prompt"][-1]["content"][::-1] and 4 <= len(row["completion"]) <= 8
    assert load_rows(cfg)[0] == rows  # the same seed, the same rows
    with pytest.raises(TrainerError, match="data.env-id 'nowhere': unknown environment"):
        load_rows(SFTDataConfig(env_id="nowhere"))
    with pytest.raises(ValueError, match="set exactly one of data.path"):
        SFTDataConfig(env_id="reverse-text", path="x.jsonl")


ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tool_tokenizer():
    """The shipped calculator model's tokenizer: byte-level, with a Hermes/Qwen-style tool-calling template."""
    return AutoTokenizer.from_pretrained(Path(__file__).parents[4] / "assets/calc-qwen3")


def test_tool_row_trains_on_the_tool_call_and_the_answer_not_on_the_tool_response(tool_tokenizer):
    cfg = SFTDataConfig(path="x.jsonl")
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 37, "b": 5}'}}
    messages = [{"role": "user", "content": "What is 37 + 5?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "42"},
                {"role": "assistant", "content": "The answer is 42."}]  # fmt: skip
    row = {"messages": messages, "tools": [ADD_TOOL]}
    sample = tokenize_row(row, "x.jsonl:1", tool_tokenizer, cfg)
    tool_call = '<tool_call>\n{"name": "add", "arguments": {"a": 37, "b": 5}}\n</tool_call>'
    assert _masked_text(tool_tokenizer, sample) == f"{tool_call}<|im_end|>\nThe answer is 42.<|im_end|>\n"
    text = tool_tokenizer.decode(sample.input_ids)
    assert text.startswith('<|im_start|>system\n<tools>\n{"type": "function", "function": {"name": "add"')
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    # The same tools given as a JSON string (as some datasets store them) give the same sample.
    assert tokenize_row(row | {"tools": json.dumps([ADD_TOOL])}, "x.jsonl:1", tool_tokenizer, cfg) == sample
    with pytest.raises(TrainerError, match="x.jsonl:1: tools must be a list of function schemas"):
        tokenize_row(row | {"tools": {"name": "add"}}, "x.jsonl:1", tool_tokenizer, cfg)


def test_tool_template_renders_each_message_as_an_append(tool_tokenizer):
    """The loss mask and the orchestrator's multi-turn rendering both need rendering to be incremental."""
    calls = [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": '{"a": 3, "b": 4}'}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2 and 3+4?"},
                {"role": "assistant", "content": "Two sums.", "tool_calls": calls},
                {"role": "tool", "content": "3"}, {"role": "tool", "content": "7"},
                {"role": "assistant", "content": "3 and 7"}, {"role": "user", "content": "thanks"}]  # fmt: skip
    for tools in ([ADD_TOOL], None):
        render = functools.partial(tool_tokenizer.apply_chat_template, tools=tools, tokenize=False)
        for k in range(1, len(messages)):
            assert render(messages[: k + 1]).startswith(render(messages[:k]))
            if messages[k]["role"] == "assistant":
                assert render(messages[: k + 1]).startswith(render(messages[:k], add_generation_prompt=True))
    text = tool_tokenizer.apply_chat_template(messages, tools=[ADD_TOOL], tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n<tools>\n")
    first, second = (f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
                     for a, b in [(1, 2), (3, 4)])  # fmt: skip
    assert f"Two sums.\n{first}\n{second}<|im_end|>\n" in text
    # Two tool results in a row: one user turn.
    assert ("<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n3 and 7<|im_end|>\n") in text  # fmt: skip
