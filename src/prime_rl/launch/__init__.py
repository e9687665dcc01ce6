"""The launcher of an RL run: inference, orchestrator and trainer as child processes of `rl`.

`services` says what each service starts with (devices, command line, config as the launcher adjusts it; the
Slurm renderer uses it too), `supervise` starts, watches, restarts and stops the processes (`eval --serve` too),
`console` shows their progress, and `run` is the one-node run of `rl`. Nothing here imports a service package
(they run in their own processes) or torch at import.
"""
