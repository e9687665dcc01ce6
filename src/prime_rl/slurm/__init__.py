"""Slurm launcher of `rl` and `sft` (`--slurm ...`; the `[slurm]` section is `configs/slurm.py`): `launch.py` renders
the job script of a layout and submits it, `script.py` holds the pieces every job script shares (the #SBATCH
header, quoting, srun lines, the script's end)."""
