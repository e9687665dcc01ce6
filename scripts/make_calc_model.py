"""The calculator tool-calling tiny model (`assets/calc-qwen3`): its chat template, SFT data and check.

The model answers "What is 37 + 5?" by calling the tool `add` with the numbers copied from the question,
then, given the tool's result, answers with that result. It exists so that tests and examples of tool
calling (OpenAI `tools` → `tool_calls`, Hermes/Qwen format) have a model that really emits tool calls.
How it is made (docs/examples/calc_tool.md has the figures):

    uv run python scripts/make_calc_model.py init outputs/calc/init            # random Qwen3 + tool template
    uv run python scripts/make_calc_model.py data outputs/calc/train.jsonl     # synthetic conversations
    uv run sft @ configs/examples/calc/sft.toml                                # SFT from random init
    uv run python scripts/make_calc_model.py check outputs/calc/sft/weights/step_1000   # greedy accuracy

One training row (`messages` + `tools`, the format `prime_rl.trainer.sft.data` reads):

    user       What is 37 + 5?
    assistant  tool_calls = [add({"a": 37, "b": 5})]
    tool       42
    assistant  42

Questions whose (a, b) pair is in `held_out_pairs()` (10 % of the pairs, seeded) never appear in the data;
`check` asks only those.

`--bash` (data, check): the same questions as verifiers' `bash` harness asks them on the `prime_rl_calc` taskset
(its system prompt, its `bash` and `edit` tools, then the taskset's `add` as verifiers' tool server describes it),
answered through bash, for `assets/calc-bash-qwen3`, which fine-tunes calc-qwen3 on those rows mixed with the plain
ones (docs/examples/agents.md):

    uv run python scripts/make_calc_model.py data outputs/calc/bash.jsonl --bash --rows 16000
    uv run sft @ configs/examples/calc/sft_bash.toml
    uv run python scripts/make_calc_model.py check outputs/calc/sft-bash/weights/final --bash

    system     You are a coding agent. You have access to a bash tool ... (and the tools)
    user       What is 37 + 5?
    assistant  tool_calls = [bash({"command": "echo $((37 + 5))"})]
    tool       42\n
    assistant  42
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from prime_rl.utils.tool_calls import parse_tool_calls

MAX_OPERAND = 99
# The tool the model is trained with; pass exactly this list as `tools` to get its tool calls.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
# `add` as verifiers' tool server (MCP) describes it to a harness: pydantic's titles kept, in its key order.
ADD_SERVED = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}},
            "required": ["a", "b"],
            "title": "addArguments",
        },
    },
}
BASH_CALL = re.compile(r"echo \$\(\((\d+) \+ (\d+)\)\)")
QUESTIONS = ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?"]

# Hermes/Qwen-style tool calling on ChatML. Every message only appends to the text of the ones before it
# (the SFT loss mask and the orchestrator's multi-turn rendering rely on that), so a run of tool results,
# rendered as one user turn, is closed by whatever follows it: the next message or the generation prompt.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
    {{- '<tools>\\n' }}
    {%- for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}
    {{- '</tools>\\nTo call a tool, answer <tool_call>\\n{"name": <name>, "arguments": <args-json>}\\n</tool_call>' }}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set after_tool = not loop.first and messages[loop.index0 - 1].role == 'tool' %}
    {%- if message.role == 'tool' %}
        {{- '' if after_tool else '<|im_start|>user' }}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
    {%- elif not (tools and loop.first and message.role == 'system') %}
        {{- '<|im_end|>\\n' if after_tool }}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function or call %}
            {%- set args = fn.arguments if fn.arguments is string else fn.arguments | tojson %}
            {{- '\\n' if message.content or not loop.first }}
            {{- '<tool_call>\\n{"name": ' + fn.name | tojson + ', "arguments": ' + args + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_end|>\\n' if messages and messages[-1].role == 'tool' }}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def held_out_pairs(seed: int = 1234, fraction: float = 0.1) -> set[tuple[int, int]]:
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    return set(random.Random(seed).sample(pairs, int(fraction * len(pairs))))


def conversation(a: int, b: int, question: str) -> list[dict]:
    """The whole exchange for `question` about a + b (the tool's arguments copied from it)."""
    call = {"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    return [
        {"role": "user", "content": question.format(a=a, b=b)},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", **call}]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


def bash_harness() -> tuple[str, list[dict]]:
    """The system prompt and tools verifiers' bash harness (edit on, search off) gives the model on prime_rl_calc."""
    from verifiers.v1.harnesses.bash.harness import BASH_SYSTEM_PROMPT, EDIT_SYSTEM_PROMPT
    from verifiers.v1.harnesses.utils.core import BASH_TOOL, EDIT_TOOL

    return f"{BASH_SYSTEM_PROMPT} {EDIT_SYSTEM_PROMPT}", [BASH_TOOL, EDIT_TOOL, ADD_SERVED]


def bash_conversation(a: int, b: int, system: str) -> list[dict]:
    """The exchange as the bash harness plays it: the sum through `bash`, whose output is the command's stdout."""
    call = {
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": f"echo $(({a} + {b}))"})},
    }
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", **call}]},
        {"role": "tool", "tool_call_id": "call_0", "content": f"{a + b}\n"},
        {"role": "assistant", "content": str(a + b)},
    ]


def write_data(path: Path, rows: int, seed: int, bash: bool = False) -> None:
    """`rows` conversations; with `bash`, every other one is the bash harness's (the rest keep the plain skill)."""
    rng, held_out = random.Random(seed), held_out_pairs()
    system, bash_tools = bash_harness() if bash else ("", [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        written = 0
        while written < rows:
            a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
            if (a, b) in held_out:
                continue
            if bash and written % 2 == 0:
                row = {"messages": bash_conversation(a, b, system), "tools": bash_tools}
            else:
                row = {"messages": conversation(a, b, rng.choice(QUESTIONS)), "tools": TOOLS}
            f.write(json.dumps(row) + "\n")
            written += 1
    print(f"wrote {rows} rows to {path}")


def init_model(path: Path, seed: int) -> None:
    """A random byte-level Qwen3 like assets/reverse-qwen3 (hidden 128, 4 layers, 4 heads of 32), our template."""
    from transformers import AutoTokenizer

    from prime_rl.utils.tiny_model import create_tiny_model

    create_tiny_model(path, "qwen3", seed, hidden_size=128, num_layers=4, tokenizer_vocab_size=259)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    (path / "tools.json").write_text(json.dumps(TOOLS, indent=2) + "\n")  # ships with the model: tests read it
    print(f"wrote the initial model to {path}")


def _greedy(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, tools=TOOLS) -> list[str]:
    import torch

    texts = [
        tokenizer.apply_chat_template(c, tools=tools, tokenize=False, add_generation_prompt=True) for c in conversations
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def _read_add(calls: list[dict], a: int, b: int) -> tuple[dict, int, bool] | None:
    """A valid `add` call's arguments, their sum and whether they are the question's; None if it is not one."""
    if len(calls) != 1 or calls[0]["function"]["name"] != "add":
        return None
    args = json.loads(calls[0]["function"]["arguments"])
    if not all(isinstance(args.get(k), int) for k in "ab"):
        return None
    return args, args["a"] + args["b"], args == {"a": a, "b": b}


def _read_bash(calls: list[dict], a: int, b: int) -> tuple[dict, int, bool] | None:
    """`_read_add` for a `bash` call `echo $((x + y))`: read, not run (the check executes nothing the model wrote)."""
    if len(calls) != 1 or calls[0]["function"]["name"] != "bash":
        return None
    command = json.loads(calls[0]["function"]["arguments"]).get("command", "")
    if not (match := BASH_CALL.fullmatch(str(command))):
        return None
    x, y = map(int, match.groups())
    return {"command": command}, x + y, (x, y) == (a, b)


def check(model_dir: Path, num: int, seed: int, bash: bool = False) -> dict:
    """Greedy accuracy on `num` held-out questions: the tool call, then the answer after the tool's result.

    The second turn is played as an agent would: the model's own call is read (if it is a valid `add` call, or
    with `bash` an `echo $((x + y))`) and its result sent back; the answer counts if it equals that result.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    pairs = rng.sample(sorted(held_out_pairs()), num)
    if bash:
        system, tools = bash_harness()
        name, read, output = "bash", _read_bash, "{}\n"
        questions = [bash_conversation(a, b, system)[:2] for a, b in pairs]
    else:
        tools, name, read, output = TOOLS, "add", _read_add, "{}"
        questions = [conversation(a, b, rng.choice(QUESTIONS))[:1] for a, b in pairs]
    first = _greedy(model, tokenizer, questions, max_new_tokens=100, tools=tools)
    counts = {"questions": num, "valid_call": 0, "right_args": 0, "answer_is_result": 0, "all_right": 0}
    followups, right = [], []
    for (a, b), question, text in zip(pairs, questions, first, strict=True):
        if (read_call := read(parse_tool_calls(text)[1], a, b)) is None:
            continue
        args, result, args_right = read_call
        counts["valid_call"] += 1
        right.append(args_right)
        counts["right_args"] += args_right
        call = {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        followups.append([*question, {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "content": output.format(result)}])  # fmt: skip
    answers = _greedy(model, tokenizer, followups, max_new_tokens=16, tools=tools) if followups else []
    for convo, args_right, answer in zip(followups, right, answers, strict=True):
        ok = answer.strip() == convo[-1]["content"].strip()
        counts["answer_is_result"] += ok
        counts["all_right"] += ok and args_right
    print(f"first generation: {first[0]!r}")
    print(json.dumps(counts))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="write the random initial model with the tool-calling chat template")
    p.add_argument("path", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("data", help="write the SFT rows (JSONL, `messages` + `tools`)")
    p.add_argument("path", type=Path)
    p.add_argument("--rows", type=int, default=24000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bash", action="store_true", help="every other row as verifiers' bash harness asks it")
    p = sub.add_parser("check", help="greedy tool-call accuracy on held-out questions")
    p.add_argument("model", type=Path)
    p.add_argument("--num", type=int, default=200)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--bash", action="store_true", help="the bash harness's conversation")
    args = parser.parse_args()
    if args.command == "init":
        init_model(args.path, args.seed)
    elif args.command == "data":
        write_data(args.path, args.rows, args.seed, args.bash)
    else:
        check(args.model, args.num, args.seed, args.bash)


if __name__ == "__main__":
    main()
