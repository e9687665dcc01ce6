"""The vLLM backend (GPU nodes): vLLM's own OpenAI server, in this process, plus our weight-update routes.

args.py maps our config to vLLM's CLI (pure, tested without vLLM); server.py runs vLLM's `serve` with the
routes added; worker.py is the worker extension that loads a `weights/step_n` dir into the model runner.
"""
