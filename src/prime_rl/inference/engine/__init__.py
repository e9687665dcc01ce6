"""The built-in PyTorch engine (CPU, or CUDA without vLLM): dynamic batching, sampling, weight swaps."""

from prime_rl.inference.engine.build import build_engine
from prime_rl.inference.engine.engine import Engine
from prime_rl.inference.engine.sampling import SamplingParams
from prime_rl.inference.engine.types import Delta, EngineBusy, EngineClosed, RequestFailed, Sample
from prime_rl.inference.engine.weights import LoadedWeights
from prime_rl.inference.weights import WeightsError

__all__ = [
    "Delta",
    "Engine",
    "EngineBusy",
    "EngineClosed",
    "LoadedWeights",
    "RequestFailed",
    "Sample",
    "SamplingParams",
    "WeightsError",
    "build_engine",
]
