"""The built-in PyTorch engine (CPU, or CUDA without vLLM): dynamic batching, sampling, weight swaps."""

from prime_rl.inference.engine.engine import Engine, Sample, build_engine
from prime_rl.inference.engine.sampling import SamplingParams
from prime_rl.inference.weights import WeightsError

__all__ = ["Engine", "Sample", "SamplingParams", "WeightsError", "build_engine"]
