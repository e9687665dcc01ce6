"""A one-rank gloo process group in the test process, for code that runs FSDP collectives."""

import pytest


@pytest.fixture(scope="session")
def one_rank():
    from prime_rl.trainer.parallel import close_distributed, init_distributed

    d = init_distributed("cpu")
    yield d
    close_distributed()
