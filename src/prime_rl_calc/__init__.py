"""The calculator taskset (`calc` of prime_rl.envs.verifiers_examples: "What is A + B?" with the `add` tool) as a
package verifiers' loader imports, for environments verifiers plays itself:

    [[orchestrator.env]]
    id = "verifiers-env"
    [orchestrator.env.args]
    taskset = { id = "prime_rl_calc" }
    agent = { harness = { id = "null" }, runtime = { type = "subprocess" } }
    renderer = { name = "custom", import_path = "prime_rl.envs.hermes_renderer.HermesTextRenderer" }

The tool runs in verifiers' own tool server (MCP) inside the runtime; the renderer reads the tiny calc model's
Hermes tool calls from its byte-level text. Importing it needs verifiers (`uv sync --extra verifiers`).
"""

from prime_rl.envs.verifiers_examples import CalcTaskset

__all__ = ["CalcTaskset"]
