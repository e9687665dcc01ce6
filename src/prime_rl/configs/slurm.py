"""The `[slurm]` section of `rl` and `sft`: what the sbatch script asks for and how the job lays out the services.
Imports no torch."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from prime_rl.configs import Section
from prime_rl.configs.base import FieldError


class SlurmConfig(Section):
    """Submit the run as a Slurm batch job instead of running it here (`--slurm`, or a `[slurm]` table)."""

    partition: Annotated[str | None, Field(description="#SBATCH --partition; unset = the cluster's default")] = None
    account: Annotated[str | None, Field(description="#SBATCH --account")] = None
    nodes: Annotated[
        int | None,
        Field(ge=1, description="#SBATCH --nodes; unset = what the layout needs (inference + trainer nodes, else 1)"),
    ] = None
    gpus_per_node: Annotated[
        int | None, Field(ge=1, description="#SBATCH --gpus-per-node; unset = no GPUs (everything on the CPUs)")
    ] = None
    cpus_per_node: Annotated[
        int | None, Field(ge=1, description="#SBATCH --cpus-per-task (one task per node); unset = Slurm's default")
    ] = None
    time: Annotated[str | None, Field(description="#SBATCH --time, e.g. 04:00:00 or 2-00:00:00")] = None
    job_name: Annotated[str | None, Field(description="#SBATCH --job-name; unset = rl or sft")] = None
    extra_sbatch: Annotated[
        list[str],
        Field(description="more #SBATCH options, one per entry (each one argument), e.g. --exclusive, --mem=0"),
    ] = []
    setup: Annotated[
        list[str],
        Field(
            description="shell lines the job runs first on the batch node (module load ..., source venv); its "
            "environment reaches every step"
        ),  # fmt: skip
    ] = []
    srun_args: Annotated[
        list[str],
        Field(
            description="extra options of every srun step, e.g. --container-image=... (pyxis), --mpi=none; passed "
            "literally ($VAR and $(...) are not expanded: write the value itself)"
        ),
    ] = []
    python: Annotated[
        str | None, Field(description="Python of the compute nodes; unset = the interpreter submitting the job")
    ] = None
    inference_nodes: Annotated[
        int | None,
        Field(ge=1, description="RL across nodes: nodes running an inference server each (the first ones)"),
    ] = None
    trainer_nodes: Annotated[
        int | None,
        Field(
            ge=1,
            description="RL across nodes: nodes of the torchrun trainer (the next ones; the orchestrator "
            "runs on the first of them)",
        ),  # fmt: skip
    ] = None
    traffic_share: Annotated[
        list[float] | None,
        Field(
            description="RL across nodes: relative share of requests per inference node (orchestrator "
            "client.traffic_share); unset = equal"
        ),  # fmt: skip
    ] = None
    rdzv_port: Annotated[
        int, Field(ge=1, le=65535, description="port of the torchrun rendezvous on the first trainer node")
    ] = 29500
    requeue: Annotated[
        bool,
        Field(
            description="#SBATCH --requeue: a run stopped by a stop signal (or preempted) is requeued and resumes "
            "from its checkpoint (needs ckpt); else --no-requeue and `sbatch run/slurm/job.sbatch` resumes it"
        ),  # fmt: skip
    ] = False
    signal_seconds: Annotated[
        int,
        Field(
            ge=0,
            description="#SBATCH --signal=USR1@N when the run checkpoints (ckpt): N seconds before the time "
            "limit the trainer checkpoints after its current step and the run stops; 0 = no signal",
        ),
    ] = 300
    dry_run: Annotated[bool, Field(description="print the job script and submit nothing")] = False

    @property
    def multi_node(self) -> bool:
        """RL: the services as srun steps on their own nodes, instead of `rl` on one node."""
        return self.inference_nodes is not None or self.trainer_nodes is not None

    @model_validator(mode="after")
    def _no_control_characters(self) -> SlurmConfig:
        """Each of these becomes one argument of a `#SBATCH` or srun line, quoted there: a newline in one would
        still start a line of shell (or end the `#SBATCH` block) in the rendered job script."""
        for name in ("job_name", "partition", "account", "time", "python", "extra_sbatch", "srun_args"):
            values = getattr(self, name)
            for value in values if isinstance(values, list) else [values]:
                if value is not None and any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
                    raise FieldError(name, f"contains a control character (a newline?): {value!r}")
        if bad := [option for option in self.extra_sbatch if not option.startswith("-")]:
            raise FieldError("extra_sbatch", f"each entry is one #SBATCH option such as --exclusive (got {bad[0]!r})")
        return self

    @model_validator(mode="after")
    def _layout(self) -> SlurmConfig:
        if not self.multi_node:
            if self.traffic_share is not None:
                raise ValueError("slurm.traffic_share is per inference node: also set slurm.inference_nodes")
            return self
        inference, trainer = self.inference_nodes or 1, self.trainer_nodes or 1
        if self.nodes is not None and self.nodes not in (inference + trainer, 1):
            raise ValueError(
                f"slurm.nodes={self.nodes} but the layout has {inference} inference + {trainer} trainer node(s); "
                "leave it unset (or 1: every service on one node, with one inference and one trainer node)"
            )
        if self.nodes == 1 and (inference, trainer) != (1, 1):
            raise ValueError("slurm.nodes=1 shares one node between 1 inference and 1 trainer node only")
        if self.traffic_share is not None and len(self.traffic_share) != inference:
            raise ValueError(f"slurm.traffic_share has {len(self.traffic_share)} entries for {inference} node(s)")
        return self
