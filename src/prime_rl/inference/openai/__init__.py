"""The built-in engine's OpenAI API, split as vLLM's entrypoint is: request models (protocol.py), request →
engine translation and response shaping (serving.py), server-sent event streams (stream.py). The routes that
use them are inference/api.py."""
