import pytest

from prime_rl.envs import EnvError, Environment, load_environment
from prime_rl.envs.reverse_text import ReverseText


def test_loads_module_function_import_path_with_args():
    env = load_environment("prime_rl.envs.reverse_text:load_environment", max_chars=9)
    assert isinstance(env, ReverseText) and isinstance(env, Environment)
    assert env.max_chars == 9


def test_unknown_id_names_it_and_lists_builtins():
    with pytest.raises(EnvError, match=r"unknown environment 'no-such-env'.*reverse-text"):
        load_environment("no-such-env")


def test_bad_import_paths_are_clear_errors():
    with pytest.raises(EnvError, match="cannot import environment module 'no_such_module_xyz'"):
        load_environment("no_such_module_xyz:make")
    with pytest.raises(EnvError, match="has no callable 'nope'"):
        load_environment("prime_rl.envs.reverse_text:nope")


def test_bad_arguments_and_non_environments_are_clear_errors():
    with pytest.raises(EnvError, match="rejected its arguments"):
        load_environment("reverse-text", colour="blue")
    with pytest.raises(EnvError, match="rejected its arguments"):
        load_environment("reverse-text", min_chars=10, max_chars=2)
    with pytest.raises(EnvError, match="lacks examples"):
        load_environment("builtins:dict")
