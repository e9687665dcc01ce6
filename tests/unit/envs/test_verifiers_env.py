"""`verifiers:<id>` environments: verifiers 0.4 tasksets (`verifiers.v1`) mapped onto our environment protocol.

No `from __future__ import annotations` here: the hooks of the tasksets built in fixtures are typed with a
fixture-local `vf`, and verifiers reads those annotations (`get_type_hints`) to route @vf.stop hooks.
"""

import asyncio
import importlib.util
import itertools
import json
import sys
import types
from pathlib import Path

import pytest

from prime_rl.envs import EnvError, is_multi_turn, load_environment

EXAMPLES = "verifiers:prime_rl.envs.verifiers_examples"
needs_verifiers = pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None,
    reason="the optional verifiers package is not installed (uv sync --extra verifiers)",
)
# The tools assets/calc-qwen3 was trained with (its tools.json): the calc env must send exactly these.
CALC_MODEL_TOOLS = json.loads((Path(__file__).resolve().parents[3] / "assets/calc-qwen3/tools.json").read_text())


def call(name: str, arguments: str, call_id: str = "call_0") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant(content: str = "", *calls: dict) -> dict:
    return {"role": "assistant", "content": content, **({"tool_calls": list(calls)} if calls else {})}


def test_verifiers_ids_say_the_optional_package_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers -> ImportError
    with pytest.raises(EnvError, match="needs the optional 'verifiers' package.*uv sync --extra verifiers"):
        load_environment("verifiers:gsm8k")


def test_verifiers_without_the_v1_stack_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", types.SimpleNamespace(__version__="0.1.9"))
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(EnvError, match=r"needs verifiers 0\.4 .*installed verifiers 0\.1\.9"):
        load_environment("verifiers:gsm8k")


@pytest.fixture(scope="module")
def vf():
    return pytest.importorskip("verifiers.v1", reason="the optional verifiers package is not installed")


@pytest.fixture(scope="module")
def local(vf):
    """Tasksets built here with verifiers' API: sync + async hooks, a failing tool and a stop, and refusals."""

    class Data(vf.TaskData):
        answer: str = "7"

    class Mixed(vf.Task[Data, vf.State, vf.TaskConfig]):
        @vf.reward(weight=2.0)
        def exact(self, task: Data, trace: vf.Trace) -> float:  # sync
            return float(trace.last_reply == task.answer)

        @vf.reward(weight=0.5)
        async def parts(self, trace: vf.Trace) -> dict:  # async, keyed scores
            return {"has_digit": float(any(c.isdigit() for c in trace.last_reply)), "short": 1.0}

        @vf.metric
        def chars(self, trace: vf.Trace) -> float:  # sync metric, never in the reward
            return float(len(trace.last_reply))

    class Tools(vf.Toolset[vf.ToolsetConfig]):
        @vf.tool
        async def add(self, a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @vf.tool
        def explode(self) -> str:
            """Always fails."""
            raise RuntimeError("boom")

    class WithTools(vf.Task[Data, vf.State, vf.TaskConfig]):
        @classmethod
        def toolsets(cls, config):
            return [Tools(vf.ToolsetConfig())]

        @vf.stop
        async def gave_up(self, trace: vf.Trace) -> bool:
            return "give up" in trace.last_reply

        @vf.reward
        async def exact(self, task: Data, trace: vf.Trace) -> float:
            return float(trace.last_reply == task.answer)

    class RuntimeReward(vf.Task[Data, vf.State, vf.TaskConfig]):
        @vf.reward
        async def file_exists(self, trace: vf.Trace, runtime) -> float:
            return 1.0

    class Intercepting(vf.Task[Data, vf.State, vf.TaskConfig]):
        @vf.intercept
        async def rewrite(self, response: vf.Response) -> None:
            return None

    class Counter(vf.State):
        calls: int = 0

    class StatefulTools(vf.Toolset[vf.ToolsetConfig, Counter]):
        @vf.tool
        async def tick(self) -> int:
            """Count."""
            return 0

    class Stateful(vf.Task[Data, vf.State, vf.TaskConfig]):
        @classmethod
        def toolsets(cls, config):
            return [StatefulTools(vf.ToolsetConfig())]

    def taskset(task_cls, prompt="What is 3 + 4?", n=3):
        class Set(vf.Taskset[task_cls, vf.TasksetConfig]):
            def load(self):
                for i in range(n):
                    yield task_cls(Data(prompt=prompt, system_prompt=f"sys {i}"), self.config.task)

        return Set(vf.TasksetConfig())

    class Endless(vf.Taskset[Mixed, vf.TasksetConfig]):
        INFINITE = True

        def load(self):
            for i in itertools.count():
                yield Mixed(Data(prompt=f"q{i}", answer=str(i)), self.config.task)

    return types.SimpleNamespace(
        mixed=taskset(Mixed), tools=taskset(WithTools), runtime=taskset(RuntimeReward),
        intercept=taskset(Intercepting), stateful=taskset(Stateful), no_prompt=taskset(Mixed, prompt=None),
        endless=Endless(vf.TasksetConfig()),
    )  # fmt: skip


def adapt(taskset, **kw):
    from prime_rl.envs.verifiers_env import adapt_taskset

    return adapt_taskset(taskset, "test", **kw)


@needs_verifiers
def test_sums_is_single_turn_with_the_system_prompt_and_answer():
    env = load_environment(f"{EXAMPLES}:sums", num_tasks=4)
    assert not is_multi_turn(env) and not hasattr(env, "respond") and env.tools == []
    ex = next(env.examples(0))
    a, b = ex.info["a"], ex.info["b"]
    assert ex.prompt == [
        {"role": "system", "content": "Solve the problem. Put the final answer in \\boxed{}."},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    assert ex.answer == str(a + b)


@needs_verifiers
def test_examples_are_a_seeded_reshuffle_of_every_task_each_epoch():
    env = load_environment(f"{EXAMPLES}:sums", num_tasks=5)
    first = [ex.prompt[1]["content"] for ex in itertools.islice(env.examples(3), 10)]
    assert first == [ex.prompt[1]["content"] for ex in itertools.islice(env.examples(3), 10)]
    assert first != [ex.prompt[1]["content"] for ex in itertools.islice(env.examples(4), 10)]
    assert sorted(first[:5]) == sorted(first[5:]) and len(set(first[:5])) == 5  # each epoch: all 5 tasks


@needs_verifiers
def test_sums_reward_is_the_weighted_sum_with_the_boxed_parser_and_each_hook_a_metric():
    env = load_environment(f"{EXAMPLES}:sums", num_tasks=2)
    ex = next(env.examples(0))
    score = lambda text: asyncio.run(env.score(text, ex))  # noqa: E731
    right = score(f"It is \\boxed{{{ex.answer}}}.")
    assert right["reward"] == pytest.approx(1.1) and (right["correct"], right["boxed"]) == (1.0, 1.0)
    assert right["reply_chars"] == len(f"It is \\boxed{{{ex.answer}}}.")
    assert score("\\boxed{-1}")["reward"] == pytest.approx(0.1)  # boxed, wrong
    assert score(f"{ex.answer}")["reward"] == 0.0  # right number, but not where the parser reads it


@needs_verifiers
def test_sync_and_async_rewards_and_metrics_are_all_scored(local):
    env = adapt(local.mixed)
    ex = next(env.examples(0))
    assert ex.prompt[0]["role"] == "system" and ex.answer == "7"
    got = asyncio.run(env.score("7", ex))
    assert got == {"exact": 1.0, "has_digit": 1.0, "short": 1.0, "chars": 1.0, "reward": 2.0 + 0.5 + 0.5}
    assert asyncio.run(env.score("seven", ex))["reward"] == pytest.approx(0.5)


@needs_verifiers
def test_an_infinite_taskset_streams_in_its_own_order(local):
    env = adapt(local.endless)
    assert env.tasks is None
    examples = list(itertools.islice(env.examples(0), 3))
    assert [ex.prompt for ex in examples] == [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    assert asyncio.run(env.score("2", examples[2]))["exact"] == 1.0  # the task is rebuilt from Example.info


@needs_verifiers
def test_calc_sends_exactly_the_calc_models_tool_and_question():
    env = load_environment(f"{EXAMPLES}:calc", num_tasks=3)
    assert is_multi_turn(env) and env.max_turns == 4
    assert env.tools == CALC_MODEL_TOOLS
    ex = next(env.examples(0))
    assert ex.prompt == [{"role": "user", "content": f"What is {ex.info['a']} + {ex.info['b']}?"}]
    assert load_environment(f"{EXAMPLES}:calc", num_tasks=3, max_turns=2).max_turns == 2


@needs_verifiers
def test_a_tool_call_runs_the_tool_and_the_final_answer_is_scored():
    env = load_environment(f"{EXAMPLES}:calc", num_tasks=3)
    ex = next(env.examples(0))
    a, b = ex.info["a"], ex.info["b"]
    turn = assistant("", call("add", json.dumps({"a": a, "b": b}), "call_x"))
    replies = asyncio.run(env.respond([*ex.prompt, turn], ex))
    assert replies == [{"role": "tool", "tool_call_id": "call_x", "content": str(a + b), "name": "add"}]
    final = assistant(str(a + b))
    assert asyncio.run(env.respond([*ex.prompt, turn, *replies, final], ex)) is None  # no call: episode over
    assert asyncio.run(env.score([turn, *replies, final], ex)) == {"correct": 1.0, "tool_calls": 1.0, "reward": 1.0}
    assert asyncio.run(env.score([turn, *replies, assistant("41")], ex))["reward"] == float(a + b == 41)


@needs_verifiers
def test_bad_tool_calls_come_back_as_error_text_in_tool_messages(local):
    env = adapt(local.tools)
    ex = next(env.examples(0))
    calls = [
        call("tools_add", '{"a": "x", "b": 1}', "1"), call("tools_explode", "{}", "2"), call("mul", "{}", "3"),
        call("tools_add", "{not json", "4"), call("tools_add", "[1, 2]", "5"),
        call("tools_add", '{"a": 1, "b": 2}', "6"),
    ]  # fmt: skip
    replies = asyncio.run(env.respond([*ex.prompt, assistant("", *calls)], ex))
    assert [r["tool_call_id"] for r in replies] == ["1", "2", "3", "4", "5", "6"]
    text = [r["content"] for r in replies]
    assert "valid integer" in text[0] and "boom" in text[1] and text[2] == "error: unknown tool 'mul'"
    assert text[3].startswith("error: invalid JSON") and "must be a JSON object, got list" in text[4]
    assert text[5] == "3"  # the tool name carries the server prefix (`tools_`), as verifiers' chat loop names it


@needs_verifiers
def test_a_stop_hook_ends_the_episode_even_with_tool_calls(local):
    env = adapt(local.tools)
    ex = next(env.examples(0))
    turn = assistant("I give up", call("tools_add", '{"a": 1, "b": 2}'))
    assert asyncio.run(env.respond([*ex.prompt, turn], ex)) is None


@needs_verifiers
def test_an_installed_taskset_id_goes_through_verifiers_loader(tmp_path, monkeypatch):
    (tmp_path / "vf_calc_shim.py").write_text(
        "from prime_rl.envs.verifiers_examples import CalcTaskset\n__all__ = ['CalcTaskset']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("verifiers:vf_calc_shim", num_tasks=3, max_value=9)  # args: the taskset config's fields
    examples = list(itertools.islice(env.examples(0), 9))
    assert len(env.tasks) == 3 and env.tools == CALC_MODEL_TOOLS
    assert all(max(ex.info["a"], ex.info["b"]) <= 9 for ex in examples)
    assert load_environment("verifiers:someone/vf-calc-shim@0.1", num_tasks=2).tasks  # hub-style id: its package
    with pytest.raises(EnvError, match="could not load taskset 'vf_calc_shim'.*num_taskz"):
        load_environment("verifiers:vf_calc_shim", num_taskz=3)
    with pytest.raises(EnvError, match="could not load taskset 'no_such_taskset_here'"):
        load_environment("verifiers:no_such_taskset_here")


@needs_verifiers
def test_envs_and_harnesses_that_drive_the_model_themselves_are_refused(tmp_path, monkeypatch):
    base = "from prime_rl.envs.verifiers_examples import SumsTaskset\nimport verifiers.v1 as vf\n"
    (tmp_path / "vf_own_env.py").write_text(
        base + "class Play(vf.Env):\n    async def run(self, task, agents):\n        pass\n"
        "__all__ = ['SumsTaskset', 'Play']\n"
    )
    (tmp_path / "vf_own_harness.py").write_text(
        base + "class Prog(vf.Harness):\n    async def launch(self, *args, **kwargs):\n        pass\n"
        "__all__ = ['SumsTaskset', 'Prog']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvError, match=r"Play defines its own Env\.run\(\).*Interaction\.turn"):
        load_environment("verifiers:vf_own_env")
    with pytest.raises(EnvError, match="bundles its own harness 'vf_own_harness'"):
        load_environment("verifiers:vf_own_harness")


@needs_verifiers
@pytest.mark.parametrize(
    "name, message",
    [
        ("runtime", r"scoring hooks \['file_exists'\] is not supported: they read a runtime"),
        ("intercept", r"@vf\.intercept hooks \['rewrite'\]"),
        ("stateful", r"Toolset StatefulTools with state is not supported"),
        ("no_prompt", r"a task without a prompt is not supported: the user opens the conversation"),
    ],
)
def test_tasks_needing_what_prime_rl_does_not_run_are_refused_by_name(local, name, message):
    with pytest.raises(EnvError, match=message):
        adapt(getattr(local, name))


@needs_verifiers
def test_a_factory_must_return_a_taskset():
    with pytest.raises(EnvError, match="returned a dict; expected a vf.Taskset"):
        load_environment("verifiers:builtins:dict", x=1)
    with pytest.raises(EnvError, match="rejected its arguments"):
        load_environment(f"{EXAMPLES}:sums", num_tasks="many")


@needs_verifiers
def test_the_container_images_an_env_config_names_are_found_and_a_subprocess_runtime_names_none():
    from verifiers.v1.utils.loaders import resolve_env_config

    from prime_rl.envs.verifiers_episodes import container_images

    def images(runtime: dict) -> set:
        args = {"taskset": {"id": "prime_rl_calc"}, "agent": {"harness": {"id": "bash"}, "runtime": runtime}}
        return container_images(resolve_env_config(args).model_dump())

    assert images({"type": "podman", "image": "localhost/a:1"}) == {("podman", "localhost/a:1")}
    assert images({"type": "docker", "image": "b:2"}) == {("docker", "b:2")}
    assert images({"type": "subprocess"}) == set()
