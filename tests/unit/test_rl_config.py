"""`rl` copies the shared keys into each sub-config and rejects inconsistent ones."""

import os

import pytest

from prime_rl.configs import ConfigError, load_config, to_toml_dict
from prime_rl.configs.inference import InferenceConfig
from prime_rl.configs.rl import RLConfig
from prime_rl.inference.vllm.args import vllm_serve_args
from prime_rl.launch.services import assign_devices, pin_cpus, service_commands, service_configs


def test_shared_keys_reach_every_sub_config():
    flags = ["--max-steps", "7", "--model.name", "m", "--output-dir", "out", "--async-level", "2"]
    config = load_config(RLConfig, flags)
    for sub in (config.trainer, config.orchestrator):
        assert (sub.max_steps, sub.async_level, sub.model.name, str(sub.output_dir)) == (7, 2, "m", "out")
    assert config.inference.model.name == "m"
    assert str(config.inference.output_dir) == "out"


def test_one_toml_with_tables_and_top_level_flag_override(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text("max_steps = 5\n[trainer]\nmax_steps = 5\n[orchestrator]\nbatch_size = 8\nrollouts_per_example = 2")
    config = load_config(RLConfig, ["@", str(path), "--max-steps", "9"])
    assert config.trainer.max_steps == config.orchestrator.max_steps == 9
    assert config.orchestrator.batch_size == 8


def test_inconsistent_shared_values_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="inconsistent model.name"):
        load_config(RLConfig, ["--trainer.model.name", "a", "--orchestrator.model.name", "b"])
    path = tmp_path / "rl.toml"
    path.write_text("max_steps = 5\n")
    with pytest.raises(ConfigError, match="max_steps is 5 but trainer.max_steps is '3'"):
        load_config(RLConfig, ["@", str(path), "--trainer.max-steps", "3"])


def test_orchestrator_follows_the_inference_port(tmp_path):
    config = load_config(RLConfig, ["--inference.server.port", "8123"])
    assert config.orchestrator.client.base_url == ["http://127.0.0.1:8123/v1"]
    # The split form: orch.toml names port 8000 for a lone orchestrator, rl starts its server on 8111. The
    # orchestrator stayed on 8000 and waited 600 s for a server that was never there.
    orch = tmp_path / "orch.toml"
    orch.write_text('[client]\nbase_url = ["http://localhost:8000/v1"]\n')
    config = load_config(RLConfig, ["--orchestrator", "@", str(orch), "--inference.server.port", "8111"])
    assert config.orchestrator.client.base_url == ["http://127.0.0.1:8111/v1"]
    # A flag naming the server's own port, or a remote server, is kept; another local port is refused.
    flag = ["--inference.server.port", "8111", "--orchestrator.client.base-url"]
    assert load_config(RLConfig, [*flag, "http://localhost:8111/v1"]).orchestrator.client.base_url == [
        "http://localhost:8111/v1"
    ]
    assert load_config(RLConfig, [*flag, "http://node7:8000/v1"]).orchestrator.client.base_url == [
        "http://node7:8000/v1"
    ]
    with pytest.raises(ConfigError, match=r"http://0.0.0.0:8000/v1 is a local port rl starts no server on"):
        load_config(RLConfig, [*flag, "http://0.0.0.0:8000/v1"])


def test_device_assignment():
    config = load_config(RLConfig, ["--trainer-cpu-ranks", "2"])
    env, ranks = assign_devices(config, num_gpus=0)
    assert ranks == 2 and env["trainer"]["CUDA_VISIBLE_DEVICES"] == ""
    env, ranks = assign_devices(load_config(RLConfig, []), num_gpus=2)
    assert env["inference"]["CUDA_VISIBLE_DEVICES"] == "0" and env["trainer"]["CUDA_VISIBLE_DEVICES"] == "1"
    config = load_config(RLConfig, ["--inference-gpu-ids", "0,1", "--trainer-gpu-ids", "2,3"])
    env, ranks = assign_devices(config, num_gpus=4)
    assert ranks == 2 and env["trainer"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ValueError, match="no CUDA device"):
        assign_devices(config, num_gpus=0)
    with pytest.raises(ValueError, match=r"GPU ids \[2, 3\] do not exist"):
        assign_devices(config, num_gpus=2)


def test_pinned_services_start_under_taskset_on_their_cores_and_others_on_every_core(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    commands = service_commands(tmp_path, 1, teacher=True)
    assert pin_cpus(load_config(RLConfig, []), commands) == commands
    config = load_config(RLConfig, ["--inference-cpus", str(cores[0]), "--trainer-cpus", str(cores[-1])])
    pinned = pin_cpus(config, commands)
    for name, core in (("inference", cores[0]), ("teacher", cores[0]), ("trainer", cores[-1])):
        assert pinned[name][1:] == ["--cpu-list", str(core), *commands[name]] and pinned[name][0].endswith("taskset")
    assert pinned["orchestrator"] == commands["orchestrator"]
    absent = max(cores) + 1
    with pytest.raises(ValueError, match=rf"--trainer-cpus {absent}: cores \[{absent}\] are not among this node's"):
        pin_cpus(load_config(RLConfig, ["--trainer-cpus", str(absent)]), commands)
    with pytest.raises(ConfigError, match="inference_cpus: pins a service of a one-node rl; slurm places"):
        load_config(RLConfig, ["--inference-cpus", "0", "--slurm.partition", "p"])


def test_a_broadcast_between_services_on_one_gpu_goes_over_gloo():
    """NCCL refuses two ranks of one group on one GPU, which is where `rl` puts both services on a 1-GPU node."""
    config = load_config(RLConfig, ["--weight-transfer", "broadcast"])
    for gpus, backend in [(1, "gloo"), (2, "auto"), (0, "auto")]:
        env, ranks = assign_devices(config, num_gpus=gpus)
        assert service_configs(config, ranks, key_in_env=False, env=env)["trainer"].weight_transfer.backend == backend
    nccl = load_config(RLConfig, ["--weight-transfer.type", "broadcast", "--weight-transfer.backend", "nccl"])
    env, ranks = assign_devices(nccl, num_gpus=1)
    assert service_configs(nccl, ranks, key_in_env=False, env=env)["trainer"].weight_transfer.backend == "nccl"


def test_on_one_gpu_rl_gives_vllm_half_the_memory_and_says_so(caplog):
    """vLLM's own default (0.92 of the GPU) beside the trainer on one GPU leaves the trainer nothing. Only the GPU
    count is faked here (this machine has no GPU: `count_gpus` would say 0); the split is the launcher's."""
    config = load_config(RLConfig, [])
    with caplog.at_level("INFO", logger="prime_rl"):
        env, ranks = assign_devices(config, num_gpus=1)
        inference = service_configs(config, ranks, key_in_env=False, env=env)["inference"]
    assert inference.gpu_memory_utilization == 0.5
    said = [r.getMessage() for r in caplog.records if "gpu_memory_utilization" in r.getMessage()]
    assert said == [
        "the trainer and inference share GPU 0: vLLM gets gpu_memory_utilization 0.5 each, leaving the trainer "
        "50% of the GPU's memory (vLLM's own default, 0.92, would leave it nothing); set "
        "--inference.gpu-memory-utilization to choose"
    ]
    # The server reads it from the config rl writes, and passes it to vLLM.
    written = InferenceConfig.model_validate(to_toml_dict(inference))
    assert "--gpu-memory-utilization" in vllm_serve_args(written, "127.0.0.1", cuda=True)
    # A share the user chose is kept; on two GPUs (or none) nothing is chosen: vLLM's own default.
    asked = load_config(RLConfig, ["--inference.gpu-memory-utilization", "0.3"])
    env, ranks = assign_devices(asked, num_gpus=1)
    assert service_configs(asked, ranks, key_in_env=False, env=env)["inference"].gpu_memory_utilization == 0.3
    for gpus in (2, 0):
        env, ranks = assign_devices(config, num_gpus=gpus)
        assert service_configs(config, ranks, key_in_env=False, env=env)["inference"].gpu_memory_utilization is None
    # The built-in engine has no such knob: nothing to choose.
    builtin = load_config(RLConfig, ["--inference.backend", "builtin"])
    env, ranks = assign_devices(builtin, num_gpus=1)
    assert service_configs(builtin, ranks, key_in_env=False, env=env)["inference"].gpu_memory_utilization is None


def test_a_teacher_server_on_the_shared_gpu_splits_the_servers_half():
    config = load_config(RLConfig, ["--teacher.model.name", "t", "--teacher.server.port", "8001",
                                    "--teacher.max-model-len", "8192"])  # fmt: skip
    env, ranks = assign_devices(config, num_gpus=1)
    subs = service_configs(config, ranks, key_in_env=False, env=env)
    assert subs["inference"].gpu_memory_utilization == subs["teacher"].gpu_memory_utilization == 0.25


def test_ckpt_switched_on_anywhere_is_shared_leaf_by_leaf():
    config = load_config(RLConfig, ["--ckpt"])
    assert config.trainer.ckpt is not None and config.orchestrator.ckpt is not None
    config = load_config(RLConfig, ["--trainer.ckpt.interval", "5", "--ckpt.resume-step", "10"])
    for sub in (config.trainer, config.orchestrator):
        assert (sub.ckpt.interval, sub.ckpt.resume_step) == (5, 10)
    with pytest.raises(ConfigError, match="inconsistent ckpt.interval"):
        load_config(RLConfig, ["--trainer.ckpt.interval", "5", "--orchestrator.ckpt.interval", "6"])
    assert load_config(RLConfig, []).trainer.ckpt is None


def test_output_dir_env_is_every_services_default_and_flags_still_win(monkeypatch, tmp_path):
    from prime_rl.configs.inference import InferenceConfig
    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.configs.trainer import TrainerConfig

    monkeypatch.setenv("OUTPUT_DIR", str(tmp_path / "shared"))  # as the multi-node commands export it
    for cls in (InferenceConfig, OrchestratorConfig, TrainerConfig):
        assert load_config(cls, []).output_dir == tmp_path / "shared"
        assert load_config(cls, ["--output-dir", "mine"]).output_dir.name == "mine"
    config = load_config(RLConfig, [])
    assert {str(getattr(config, s).output_dir) for s in ("inference", "orchestrator", "trainer")} == {
        str(tmp_path / "shared")
    }
    monkeypatch.delenv("OUTPUT_DIR")
    assert str(load_config(TrainerConfig, []).output_dir) == "outputs"


def test_output_dir_env_outranks_the_shipped_configs_and_says_so(monkeypatch, tmp_path):
    """Every configs/debug/*.toml sets output_dir = "outputs/debug", which used to win over an exported
    $OUTPUT_DIR without a word: each node of a multi-node run wrote its own outputs/debug. Now --output-dir >
    $OUTPUT_DIR > a file's > outputs, and each file value the variable replaces is one note."""
    from prime_rl.configs.inference import InferenceConfig
    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.configs.trainer import TrainerConfig

    shared = tmp_path / "shared"
    monkeypatch.setenv("OUTPUT_DIR", str(shared))
    for cls, toml in ((InferenceConfig, "infer"), (OrchestratorConfig, "orch"), (TrainerConfig, "train")):
        notes: list[str] = []
        assert load_config(cls, ["@", f"configs/debug/{toml}.toml"], notes=notes).output_dir == shared
        assert notes == [f"output_dir: $OUTPUT_DIR ({shared}) over configs/debug/{toml}.toml's outputs/debug"]
        assert str(load_config(cls, ["@", f"configs/debug/{toml}.toml", "--output-dir", "mine"]).output_dir) == "mine"
    notes = []
    config = load_config(
        RLConfig, ["@", "configs/debug/rl.toml", "--trainer", "@", "configs/debug/train.toml"], notes=notes
    )
    assert {getattr(config, s).output_dir for s in ("inference", "orchestrator", "trainer")} == {shared}
    assert len(notes) == 2 and notes[1].startswith("trainer.output_dir: $OUTPUT_DIR")
    config = load_config(RLConfig, ["@", "configs/debug/rl.toml", "--output-dir", "mine"])
    assert {str(getattr(config, s).output_dir) for s in ("inference", "orchestrator", "trainer")} == {"mine"}
    monkeypatch.delenv("OUTPUT_DIR")
    assert str(load_config(TrainerConfig, ["@", "configs/debug/train.toml"]).output_dir) == "outputs/debug"


def test_rl_with_top_p_or_top_k_needs_a_backend_that_returns_sampling_masks():
    """The trainer replays each token's kept set; vLLM returns it only when started with --return-sampling-mask
    (GPU), so vLLM without the flag is refused up front."""
    sampling = load_config(RLConfig, ["--orchestrator.sampling.top-p", "0.9", "--orchestrator.sampling.top-k", "20"])
    assert (sampling.orchestrator.sampling.top_p, sampling.orchestrator.sampling.top_k) == (0.9, 20)
    with pytest.raises(ConfigError, match=r"orchestrator.sampling.top_k.*only with\s+inference.vllm.return-sampling"):
        load_config(RLConfig, ["--orchestrator.sampling.top-k", "5", "--inference.backend", "vllm"])
    assert load_config(RLConfig, ["--inference.backend", "vllm"]).orchestrator.sampling.filtered is False
    masked = ["--orchestrator.sampling.top-p", "0.9", "--inference.backend", "vllm"]
    masked += ["--inference.vllm.return-sampling-mask", "true"]
    assert load_config(RLConfig, masked).orchestrator.sampling.top_p == 0.9  # the server refuses it on a CPU


def test_rows_counting_shared_prompts_once_need_a_trainer_that_computes_them_once():
    """orchestrator.share_prompts packs more than seq_len tokens into a row; a trainer that does not share prompts
    (share_prompts off, or on CUDA) would compute all of them, so rl refuses the pair up front."""
    on = ["--orchestrator.share-prompts", "true"]
    assert load_config(RLConfig, on).orchestrator.share_prompts is True
    with pytest.raises(ConfigError, match=r"orchestrator.share_prompts.*trainer.share_prompts is off"):
        load_config(RLConfig, [*on, "--trainer.share-prompts", "false"])
    with pytest.raises(ConfigError, match=r"orchestrator.share_prompts.*trainer.device is cuda"):
        load_config(RLConfig, [*on, "--trainer.device", "cuda"])


def test_config_mistakes_are_one_line_errors_not_tracebacks(tmp_path):
    """Each of these was a traceback, or silently resolved (issue: config errors as tracebacks)."""
    import os
    import subprocess
    import sys

    with pytest.raises(ConfigError, match="max_steps is '3' but trainer.max_steps is '7'"):
        load_config(RLConfig, ["--max-steps", "3", "--trainer.max-steps", "7"])
    binary = tmp_path / "rl.toml"
    binary.write_bytes(b"max_steps = 3\n\xff\xfe = 1\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(TOML is UTF-8\): byte 14"):
        load_config(RLConfig, ["@", str(binary)])
    env = os.environ | {"PRIME_MAX_STEPS": "abc"}
    cmd = [sys.executable, "-m", "prime_rl.entrypoints.rl", "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "max_steps: Input should be a valid integer" in result.stderr and "[env PRIME_MAX_STEPS]" in result.stderr


def test_a_service_reports_only_what_this_run_logged(tmp_path):
    """On resume the log files are appended to; a failing service's tail used to show an earlier run's traceback."""
    import sys

    from prime_rl.launch.supervise import Service

    log = tmp_path / "logs" / "trainer.log"
    log.parent.mkdir()
    log.write_text("Traceback (most recent call last):\nOldError: from the earlier run\n")
    service = Service("trainer", [sys.executable, "-c", "print('this run')"], log, {})
    service.proc.wait(30)
    assert service.tail() == "this run"
    assert "OldError" in log.read_text()  # the earlier run's lines stay in the file


def test_restart_needs_checkpoints_to_restart_from():
    with pytest.raises(ConfigError, match="--restart resumes a dead service from its checkpoint: also set --ckpt"):
        load_config(RLConfig, ["--restart", "2"])
    config = load_config(RLConfig, ["--restart", "2", "--ckpt.interval", "5"])
    assert config.restart == 2 and config.trainer.ckpt.interval == config.orchestrator.ckpt.interval == 5


def test_weight_transfer_is_one_section_with_a_type_and_a_string_shorthand(tmp_path, capsys, monkeypatch):
    from prime_rl.configs import parse_config
    from prime_rl.configs.trainer import TrainerConfig

    def transfer(*argv: str) -> tuple:
        wt = load_config(TrainerConfig, list(argv)).weight_transfer
        return wt.type, wt.host, wt.port, wt.timeout

    # The shorthand: a bare string is the type, with the default broadcast settings, and it merges with the
    # section's other keys in either order.
    short = tmp_path / "short.toml"
    short.write_text('weight_transfer = "broadcast"\n')
    assert (
        transfer("@", str(short))
        == transfer("--weight-transfer", "broadcast")
        == transfer("--weight-transfer=broadcast")
        == ("broadcast", "127.0.0.1", 29600, 600.0)
    )
    with_port = ("broadcast", "127.0.0.1", 29601, 600.0)
    assert transfer("@", str(short), "--weight-transfer.port", "29601") == with_port
    assert transfer("--weight-transfer.port", "29601", "--weight-transfer", "broadcast") == with_port
    monkeypatch.setenv("PRIME_WEIGHT_TRANSFER", "broadcast")  # the env var takes it too
    assert transfer()[0] == "broadcast"
    monkeypatch.delenv("PRIME_WEIGHT_TRANSFER")
    assert transfer()[0] == "filesystem"
    # The table form, and its flags.
    table = tmp_path / "table.toml"
    table.write_text('[weight_transfer]\ntype = "broadcast"\nhost = "10.0.0.3"\nport = 29601\n')
    flags = "--weight-transfer.type broadcast --weight-transfer.host 10.0.0.3 --weight-transfer.port 29601".split()
    assert transfer("@", str(table)) == transfer(*flags) == ("broadcast", "10.0.0.3", 29601, 600.0)

    # `rl` shares the whole section, set once (shorthand or table, at the top or in one service), into every service.
    for argv in (["--weight-transfer", "broadcast", "--weight-transfer.port", "29601"],
                 ["@", str(short), "--trainer.weight-transfer.port", "29601"]):  # fmt: skip
        config = load_config(RLConfig, argv)
        for sub in (config.trainer, config.orchestrator, config.inference):
            assert (sub.weight_transfer.type, sub.weight_transfer.port) == ("broadcast", 29601)
    with pytest.raises(ConfigError, match="inconsistent weight_transfer.type"):
        load_config(
            RLConfig, ["--trainer.weight-transfer", "broadcast", "--orchestrator.weight-transfer", "filesystem"]
        )

    # The former [weight_broadcast] section is a config error (exit 2) saying where its settings went.
    old = tmp_path / "old.toml"
    old.write_text("[weight_broadcast]\nport = 29601\n")
    for argv, line in [
        (["@", str(old)],
         f"weight_broadcast: unknown key [{old}]; the weight_broadcast settings are now "
         "weight_transfer.host/port/timeout"),
        (["--weight-broadcast.port", "29601"],
         "unknown option --weight-broadcast.port (flag); see --help; the --weight-broadcast settings are now "
         "--weight-transfer.host/port/timeout"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            parse_config(RLConfig, argv, prog="rl")
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines() == [f"rl: config error: {line}"]


def test_a_missing_local_model_path_is_checked_where_the_command_runs_not_at_slurm_submission(tmp_path):
    """The job's node checks it (a shared FS, or weights an earlier step writes); Python callers don't either."""
    from prime_rl.configs.cli import parse_config

    missing = str(tmp_path / "weights" / "final")
    assert parse_config(RLConfig, ["--model.name", missing, "--slurm"], prog="rl").trainer.model.name == missing
    assert load_config(RLConfig, ["--model.name", missing]).inference.model.name == missing
    with pytest.raises(SystemExit) as exit_:
        parse_config(RLConfig, ["--model.name", missing], prog="rl")
    assert exit_.value.code == 2


def test_a_shared_key_set_at_the_top_wins_over_a_services_env_var(monkeypatch, tmp_path):
    """A file or flag is above an env var: it was refused as a conflict, blamed on the file."""
    monkeypatch.setenv("PRIME_TRAINER__MAX_STEPS", "0")
    (tmp_path / "rl.toml").write_text("max_steps = 4\n")
    for argv in (["@", str(tmp_path / "rl.toml")], ["--max-steps", "4"]):
        config = load_config(RLConfig, argv)
        assert (config.trainer.max_steps, config.orchestrator.max_steps) == (4, 4)


def test_a_node_without_a_gpu_driver_counts_no_gpu_without_importing_torch():
    """`rl` on a laptop or CI box starts its services ~2 s sooner: no torch import to learn there is no GPU."""
    import os
    import subprocess
    import sys

    from prime_rl.launch.services import GPU_DRIVER_PATHS

    if any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        pytest.skip("this machine has a GPU driver: count_gpus asks torch")
    code = "import sys; from prime_rl.launch.services import count_gpus; print(count_gpus(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "False"]
