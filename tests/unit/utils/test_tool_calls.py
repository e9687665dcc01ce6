import doctest
import json

import prime_rl.utils.tool_calls as tool_calls_module
from prime_rl.utils.tool_calls import parse_tool_calls


def block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


ADD = '{"name": "add", "arguments": {"a": 3, "b": 4}}'


def test_module_doctests_pass():
    assert doctest.testmod(tool_calls_module).failed == 0


def test_text_without_tool_calls_is_stripped_content_and_no_calls():
    assert parse_tool_calls("  The answer is 7.\n") == ("The answer is 7.", [])


def test_one_call_is_removed_from_content_and_returned_in_openai_shape():
    content, calls = parse_tool_calls("Let me add.\n" + block(ADD))
    assert content == "Let me add."
    assert len(calls) == 1
    call = calls[0]
    assert set(call) == {"id", "type", "function"}
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == "add"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"a": 3, "b": 4}


def test_several_calls_keep_their_order_and_get_distinct_ids():
    text = block(ADD) + "\n" + block('{"name": "mul", "arguments": {"x": 2}}')
    content, calls = parse_tool_calls(text)
    assert content == ""
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert calls[0]["id"] != calls[1]["id"]


def test_ids_are_deterministic_given_the_text_and_differ_for_other_text():
    text = block(ADD)
    assert parse_tool_calls(text) == parse_tool_calls(text)
    other = block('{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert parse_tool_calls(text)[1][0]["id"] != parse_tool_calls(other)[1][0]["id"]


def test_malformed_blocks_stay_in_content_and_give_no_call():
    for payload in [
        "not json",
        '{"arguments": {}}',
        '{"name": "", "arguments": {}}',
        "[1, 2]",
        '{"name": "f", "arguments": 3}',
    ]:
        text = "x " + block(payload)
        assert parse_tool_calls(text) == (text.strip(), []), payload


def test_a_malformed_block_does_not_hide_a_good_one_after_it():
    bad = "<tool_call>\n{oops\n"
    content, calls = parse_tool_calls(bad + block(ADD))
    assert content == bad.strip()
    assert [c["function"]["name"] for c in calls] == ["add"]


def test_an_unclosed_last_block_is_a_call_like_vllms_hermes_parser():
    content, calls = parse_tool_calls("ok <tool_call>\n" + ADD + "\n")
    assert content == "ok"
    assert calls[0]["function"]["name"] == "add"


def test_a_truncated_unclosed_block_stays_content():
    text = '<tool_call>\n{"name": "add", "argu'
    assert parse_tool_calls(text) == (text, [])


def test_missing_arguments_are_an_empty_object_and_string_arguments_are_parsed():
    _, calls = parse_tool_calls(block('{"name": "now"}') + block('{"name": "add", "arguments": "{\\"a\\": 1}"}'))
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"a": 1}']


def test_non_ascii_arguments_are_kept_verbatim():
    _, calls = parse_tool_calls(block('{"name": "say", "arguments": {"text": "héllo"}}'))
    assert calls[0]["function"]["arguments"] == '{"text": "héllo"}'
