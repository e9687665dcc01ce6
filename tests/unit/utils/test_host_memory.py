"""The trainer's malloc setting (utils/host_memory.py): memory one step freed serves the next, no fresh pages."""

import subprocess
import sys

import pytest

# A step's activations as torch's CPU allocator takes them (posix_memalign, i.e. glibc's malloc): three 24 MiB
# blocks (a SwiGLU of 2,048 tokens of Qwen3-0.6B's MLP: gate, up and their product), written, then freed.
STEP = """
import ctypes, resource, sys
from prime_rl.utils.host_memory import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size = 2048 * 3072 * 4

def step():
    blocks = [libc.malloc(size) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_memory_a_step_freed_serves_the_next_without_page_faults():
    faults = {}
    for mode in ("default", "kept"):
        done = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        faults[mode] = int(done.stdout.split()[-1])
    # glibc's default maps and zeroes every block again each step: 10 x 3 x 6,144 pages of 4 KiB
    assert faults["kept"] < 100 and faults["default"] > 10 * 3 * 6144 // 2, faults
