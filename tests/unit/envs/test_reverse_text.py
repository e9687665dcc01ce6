import itertools

import pytest

from prime_rl.envs import Example, load_environment
from prime_rl.envs.reverse_text import SYSTEM_PROMPT, ReverseText


def test_examples_are_deterministic_for_a_seed_and_differ_across_seeds():
    env = ReverseText()
    a = [e.prompt[1]["content"] for e in itertools.islice(env.examples(3), 20)]
    b = [e.prompt[1]["content"] for e in itertools.islice(env.examples(3), 20)]
    c = [e.prompt[1]["content"] for e in itertools.islice(env.examples(4), 20)]
    assert a == b
    assert a != c
    assert len(set(a)) == 20


def test_example_prompt_answer_and_length_range():
    env = ReverseText(min_chars=5, max_chars=12)
    for example in itertools.islice(env.examples(0), 200):
        system, user = example.prompt
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        assert user["role"] == "user"
        text = user["content"]
        assert 1 <= len(text) <= 12 and text == text.strip()
        assert set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
        assert example.answer == text[::-1]


def test_score_is_one_for_exact_reverse_and_low_for_unrelated_text():
    env = ReverseText()
    example = Example(prompt=[], answer="olleh dlrow")
    assert env.score("olleh dlrow", example) == 1.0
    assert env.score("  olleh dlrow\n", example) == 1.0
    assert env.score("hello world", example) < 0.5
    assert env.score("zzzz", example) == 0.0
    assert env.score("", example) == 0.0
    assert env.score("dc b", Example(prompt=[], answer="dc ba")) == pytest.approx(8 / 9)


def test_reverse_text_is_a_builtin_and_takes_args():
    env = load_environment("reverse-text", min_chars=3, max_chars=3)
    example = next(env.examples(0))
    assert len(example.prompt[1]["content"]) <= 3


def test_typo_rate_slips_the_reference_answers_but_not_the_texts_or_the_score():
    exact = list(itertools.islice(ReverseText(typo_rate=0.0).examples(5), 400))
    slipped = list(itertools.islice(ReverseText(typo_rate=0.2).examples(5), 400))
    assert [e.info["text"] for e in slipped] == [e.info["text"] for e in exact]
    pairs = [(a, b) for e, s in zip(exact, slipped, strict=True) for a, b in zip(e.answer, s.answer, strict=True)]
    changed = sum(a != b for a, b in pairs) / len(pairs)
    assert 0.17 < changed < 0.22, changed  # 0.2 · 25/26: a slip may draw the same letter
    env = ReverseText(typo_rate=0.2)
    for example in slipped[:50]:
        assert env.score(example.info["text"][::-1], example) == 1.0  # scored on the true reversal
    with pytest.raises(ValueError, match="typo_rate"):
        ReverseText(typo_rate=1.0)
