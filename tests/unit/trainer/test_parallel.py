import subprocess
import sys
import textwrap

import pytest

# Its own process: the allocator setting is process-wide, and the fault count must be this step's alone.
STEPS = textwrap.dedent(
    """
    import resource, sys
    from prime_rl.trainer.fake_data import pack_samples, random_samples
    from prime_rl.trainer.model import build_model
    from prime_rl.trainer.optim import build_optimizer
    from prime_rl.trainer.parallel import init_distributed
    from prime_rl.trainer.rl.config import TrainerConfig
    from prime_rl.trainer.rl.train import train_step

    config = TrainerConfig(model={"name": sys.argv[1]}, device="cpu")
    d = init_distributed("cpu")
    model = build_model(sys.argv[1])
    optimizer = build_optimizer(model, config.optim)
    rows = pack_samples(random_samples(16, 16, 512, 200, seed=0), 2048, seed=0)
    for _ in range(3):
        train_step(model, optimizer, rows, config, d)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    train_step(model, optimizer, rows, config, d)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tunes glibc's allocator")
def test_a_cpu_training_step_reuses_freed_memory_instead_of_faulting_it_in_again(tiny_model):
    out = subprocess.run([sys.executable, "-c", STEPS, str(tiny_model)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # glibc's defaults hand large freed blocks back to the kernel: ~10,000 faults (40 MiB) per step here.
    assert int(out.stdout.split()[-1]) < 500
