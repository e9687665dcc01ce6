"""SFT data: completion-only masks with the chat template, malformed rows named by file:line, batch order."""

import json

import pytest
from transformers import AutoTokenizer

from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.packing import first_fit_decreasing
from prime_rl.trainer.sft.config import SFTDataConfig
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
