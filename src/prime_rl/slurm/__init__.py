"""Slurm launcher of `rl` and `sft` (`--slurm ...`): `config.py` holds the `[slurm]` section (imports no torch),
`launch.py` renders the job script of a layout and submits it."""
