import pytest

from prime_rl.envs import Example


class TwoTurns:
    """An environment of two model turns around one env reply, every rollout scored 1."""

    max_turns = 2

    def examples(self, seed):
        while True:
            yield Example(prompt=[{"role": "user", "content": "hi"}], answer="")

    def respond(self, messages, example):
        return "again" if len(messages) < 3 else None

    def score(self, conversation, example):
        return 1.0


@pytest.fixture
def two_turns() -> TwoTurns:
    return TwoTurns()
