"""The real trainer entrypoints (torchrun with 2 ranks, plain `trainer` with 1) on hand-written rank files.

Also the documented multi-node command: two `torchrun --nnodes 2 --node-rank {0,1} --rdzv-endpoint ...`
launches rendezvousing over loopback compute the same step as one `torchrun --nproc-per-node 2` launch, and
their 2-rank checkpoint converts (`convert-checkpoint`, no process group) into an HF dir with the same logits.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from prime_rl.protocol import is_stable, weights_dir
from prime_rl.protocol.records import PackedRow, write_rank_file
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.model import build_model
from prime_rl.utils.hf_layout import iter_safetensors
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port, probe_client
from prime_rl.utils.tiny_model import create_tiny_model
from tests.processes import finish, first_line
from tests.samples import on_policy_sample

pytestmark = pytest.mark.slow

TRAIN_PY = Path(__file__).parents[2] / "src" / "prime_rl" / "entrypoints" / "trainer.py"
TRAINER = Path(sys.executable).parent / "trainer"


def _micro_batches(tiny_model, num: int, seed: int = 0) -> list[PackedRow]:
    """`num` packed micro batches of random samples; μ = the base model's logprobs (ratios ≈ 1)."""
    model = build_model(str(tiny_model))
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        samples = []
        for _ in range(3):
            n = int(torch.randint(6, 24, (1,), generator=g))
            ids = torch.randint(3, 1000, (n,), generator=g).tolist()
            samples.append(on_policy_sample(model, ids, 4, float(torch.randn(1, generator=g))))
        batches.append(PackedRow.pack(samples, temperature=1.0))
    return batches


def _args(tiny_model, out: Path, timeout: float = 60) -> list[str]:
    return ["--model.name", str(tiny_model), "--output-dir", str(out), "--max-steps", "1", "--optim.lr", "1e-3",
            "--data.timeout", str(timeout)]  # fmt: skip


def _torchrun(nproc: int, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(TRAIN_PY)]
    return subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _node(node_rank: int, rdzv: str, args: list[str]) -> subprocess.Popen:
    """One "node" of the documented two-node command, both on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
           "--nproc-per-node", "1", "--rdzv-endpoint", rdzv, "--local-ranks-filter", "0", str(TRAIN_PY)]  # fmt: skip
    # torchrun pins OMP_NUM_THREADS=1 only when it starts several processes per node; pin it here too so
    # both launches sum in the same order and the weights can be compared at 1e-6.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float = 150) -> tuple[int, str]:
    return finish(proc, "trainer", timeout)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every trainer run of this file, started together: most of their time is importing torch, which overlaps."""
    root = tmp_path_factory.mktemp("trainer")
    batches = _micro_batches(tiny_model, 4)
    dirs = {name: root / name for name in ("split", "whole", "uneven", "missing", "multi", "lora")}
    for name in ("split", "multi", "lora"):
        write_rank_file(dirs[name], 0, 0, batches[:2])
        write_rank_file(dirs[name], 0, 1, batches[2:])
    write_rank_file(dirs["whole"], 0, 0, batches)
    write_rank_file(dirs["uneven"], 0, 0, batches[:2])
    write_rank_file(dirs["uneven"], 0, 1, batches[2:3])
    procs = {
        "split": _torchrun(2, _args(tiny_model, dirs["split"])),
        # One rank as the plain console script (a one-process group; torchrun with one rank is what
        # `rl` launches, covered by test_rl.py): one torch import fewer than a torchrun launcher + worker.
        "whole": subprocess.Popen([str(TRAINER), *_args(tiny_model, dirs["whole"])],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        "uneven": _torchrun(2, _args(tiny_model, dirs["uneven"])),
        "lora": _torchrun(2, [*_args(tiny_model, dirs["lora"]), *LORA]),
        "missing": subprocess.Popen([str(TRAINER), *_args(tiny_model, dirs["missing"], timeout=2)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }  # fmt: skip
    # weight_transfer = broadcast, 2 steps (step 1 is broadcast, the last one only written): with 2 ranks
    # and a real server; with 2 ranks and a receiver that stalls and is killed; with no receiver at all.
    for name in ("bcast", "stall", "lonely"):
        dirs[name] = root / name
        for step in (0, 1):
            write_rank_file(dirs[name], step, 0, batches if name == "lonely" else batches[:2])
            if name != "lonely":
                write_rank_file(dirs[name], step, 1, batches[2:])
    ports = {name: free_port() for name in ("bcast", "stall", "lonely")}

    def broadcasting(name: str, *extra: str) -> list[str]:
        return ["--model.name", str(tiny_model), "--output-dir", str(dirs[name]), "--optim.lr", "1e-3",
                "--max-steps", "2", "--weight-transfer", "broadcast",
                "--weight-transfer.port", str(ports[name]), "--weight-transfer.timeout", "20", *extra]  # fmt: skip

    procs["bcast"] = _torchrun(2, broadcasting("bcast", "--data.timeout", "120"))
    # Its test runs after most of this file's (~2 min in): the trainer waits longer than that for the ask.
    procs["stall"] = _torchrun(2, broadcasting("stall", "--data.timeout", "400"))
    procs["lonely"] = subprocess.Popen([str(TRAINER), *broadcasting("lonely", "--data.timeout", "3")],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    # The export's memory: 2 ranks, a 14 M-parameter model (55 MB in fp32), one step on generated data.
    dirs["export"] = root / "export"
    big = create_tiny_model(root / "big", hidden_size=512, num_layers=4)
    procs["export"] = _torchrun(2, ["--model.name", str(big), "--output-dir", str(dirs["export"]), "--max-steps",
                                    "1", "--data.fake", "--data.fake-seq-len", "64", "--data.fake-micro-batches", "1",
                                    "--data.fake-max-len", "64", "--log.level", "DEBUG"])  # fmt: skip
    rdzv = f"127.0.0.1:{free_port()}"
    nodes = [_node(n, rdzv, [*_args(tiny_model, dirs["multi"]), "--ckpt"]) for n in (0, 1)]
    yield {
        **{name: (procs[name], dirs[name]) for name in procs},
        "multi": (nodes, dirs["multi"]),
        "ports": ports,
        "batches": batches,
    }
    for proc in [*procs.values(), *nodes]:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


LORA = ["--model.lora.rank", "4", "--model.lora.alpha", "8"]


def test_lora_on_two_fsdp_ranks_trains_the_adapter_of_one_rank(tiny_model, runs, one_rank):
    """FSDP2 over the LoRA-wrapped model (frozen base, trainable adapters in the same units): the 2-rank
    step's adapter equals one rank's on the same 4 micro batches, and only the adapter (and its checksum) is written."""
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.loading import build_training
    from prime_rl.trainer.rl.train import train_step
    from prime_rl.trainer.weights import adapter_state

    proc, out = runs["lora"]
    rc, output = _finish(proc)
    assert rc == 0, output[-6000:]
    assert sorted(p.name for p in weights_dir(out, 1).iterdir()) == [
        "STABLE", "adapter_config.json", "adapter_model.safetensors", "checksum.json"
    ]  # fmt: skip
    two_ranks = load_file(weights_dir(out, 1) / "adapter_model.safetensors")

    config = TrainerConfig(
        model={"name": str(tiny_model), "lora": {"rank": 4, "alpha": 8}}, output_dir=out, device="cpu",
        optim={"lr": 1e-3},
    )  # fmt: skip
    torch.manual_seed(config.seed)  # the trainer's own seeding: lora_A starts from the same draw
    model, optimizer, _ = build_training(config, one_rank, max_steps=1)
    train_step(model, optimizer, [MicroBatch.from_row(b) for b in runs["batches"]], config, one_rank)
    one_rank_adapter = adapter_state(model)
    assert two_ranks.keys() == one_rank_adapter.keys()
    for name, value in one_rank_adapter.items():
        torch.testing.assert_close(two_ranks[name], value.detach(), atol=1e-5, rtol=0, msg=name)
    assert any(two_ranks[n].abs().max() > 5e-4 for n in two_ranks if ".lora_B." in n)  # B moved off 0


def test_two_ranks_and_one_rank_produce_the_same_weights(tiny_model, runs):
    (split_proc, split), (whole_proc, whole) = runs["split"], runs["whole"]
    for proc in (split_proc, whole_proc):
        rc, output = _finish(proc)
        assert rc == 0, output[-6000:]

    base = load_file(tiny_model / "model.safetensors")
    new = {}
    for out in (split, whole):
        path = weights_dir(out, 1)
        assert is_stable(path)
        assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
        new[out] = dict(iter_safetensors(path))
        assert new[out].keys() == base.keys()
    for name in base:
        torch.testing.assert_close(new[split][name], new[whole][name], atol=1e-5, rtol=0, msg=name)
    # Each of the 2 ranks wrote its own file (no full gather on rank 0); 1 rank writes one file, as before.
    split_files = sorted(p.name for p in weights_dir(split, 1).glob("model*"))
    assert split_files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json"]  # fmt: skip
    assert sorted(p.name for p in weights_dir(whole, 1).glob("model*")) == ["model.safetensors"]
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    logits = [AutoModelForCausalLM.from_pretrained(weights_dir(out, 1))(ids).logits for out in (split, whole)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    changed = max((new[whole][name] - base[name]).abs().max().item() for name in base)
    assert changed > 5e-4  # Adam's first step moves weights by about lr

    # Same step, same statistics, however the data was split; only rank 0 logs, one line per step.
    m_split, m_whole = read_metrics(split, "trainer"), read_metrics(whole, "trainer")
    assert [m["step"] for m in m_split] == [0]
    for key in ("loss", "entropy", "mismatch_kl", "grad_norm", "num_loss_tokens", "num_samples", "num_tokens"):
        assert m_split[0][key] == pytest.approx(m_whole[0][key], rel=1e-4, abs=1e-7), key
    assert m_whole[0]["mismatch_kl"] < 1e-6 and m_whole[0]["clip_frac"] == 0.0
    log = (split / "logs" / "trainer.log").read_text()
    assert "step 0 | loss" in log and "tok/s" in log
    assert sorted(p.name for p in (split / "logs").iterdir()) == ["trainer.log"]


def test_ranks_with_different_micro_batch_counts_fail_with_a_clear_message(runs):
    proc, out = runs["uneven"]
    rc, output = _finish(proc)
    assert rc != 0
    assert "ranks hold between 1 and 2 micro batches" in (out / "logs" / "trainer.log").read_text(), output[-6000:]
    assert not weights_dir(out, 1).exists()


def test_missing_rank_file_exits_nonzero_naming_what_it_waited_for(runs):
    proc, _ = runs["missing"]
    rc, output = _finish(proc, timeout=90)
    assert rc == 1, output[-4000:]
    assert "timed out after 2s waiting for rollouts for step 0" in output
    assert "rollouts/step_0/rank_0.safetensors" in output
    assert "Traceback" not in output


def test_two_node_launch_computes_the_same_step_as_one_two_rank_launch(runs):
    (split_proc, split), (nodes, multi) = runs["split"], runs["multi"]
    rc, output = _finish(split_proc)
    assert rc == 0, output[-6000:]
    node_outputs = []
    for proc in nodes:
        rc, output = _finish(proc)
        assert rc == 0, output[-6000:]
        node_outputs.append(output)
    assert "step 0 | loss" in node_outputs[0]  # node 0 shows global rank 0's log (--local-ranks-filter 0)
    a, b = dict(iter_safetensors(weights_dir(split, 1))), dict(iter_safetensors(weights_dir(multi, 1)))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    assert is_stable(multi / "checkpoints" / "step_1" / "trainer")


def test_converted_two_rank_checkpoint_loads_in_transformers_with_the_same_logits(runs, tmp_path):
    nodes, multi = runs["multi"]
    for proc in nodes:
        rc, output = _finish(proc)
        assert rc == 0, output[-6000:]
    out = tmp_path / "hf"
    # Converted in a process without any process group, into small shards to exercise the index.
    cmd = [str(TRAINER.parent / "convert-checkpoint"), str(multi / "checkpoints" / "step_1"), str(out),
           "--max-shard-size", "100KB"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    converted = AutoModelForCausalLM.from_pretrained(out)
    exported = AutoModelForCausalLM.from_pretrained(weights_dir(multi, 1))
    ids = torch.randint(3, 1000, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, exported(ids).logits, atol=1e-5, rtol=0)

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # refuses to overwrite
    assert again.returncode == 1 and "exists and is not empty" in again.stderr and "Traceback" not in again.stderr


def test_bench_on_fake_data_prints_the_table_and_writes_no_weights(tiny_model, tmp_path):
    cmd = [str(TRAINER), "--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--data.fake", "--bench",
           "--max-steps", "3", "--data.fake-seq-len", "256", "--bench-peak-tflops", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if "step time (s)" in line)
    for column in ("tokens/step", "tokens/s", "TFLOP/s", "MFU", "peak mem (GiB)"):
        assert column in header
    row = next(line for line in proc.stdout.splitlines() if line.strip("│ ").startswith("2 "))  # 2 steps after warm-up
    assert "%" in row  # MFU from --bench-peak-tflops
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")] == [0, 1, 2]
    assert not (tmp_path / "weights").exists()
    assert "benchmark, no weights written" in proc.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 1.2 MB tmpfs: room for one weights step of the tiny model, not two."""
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a small tmpfs needs root: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_is_one_line_naming_the_path_and_leaves_nothing_half_written(tiny_model, small_disk):
    cmd = [str(TRAINER), "--model.name", str(tiny_model), "--output-dir", str(small_disk), "--data.fake",
           "--max-steps", "4", "--data.fake-seq-len", "64", "--data.fake-max-len", "32"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr  # FATAL: a restart cannot help, `rl --restart` does not retry
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "no space left on the device of" in errors[0], result.stderr
    assert f"{small_disk}/weights/step_" in errors[0] or f"{small_disk}/metrics" in errors[0], errors
    # What was written before is complete; what failed left no partial directory behind.
    assert is_stable(weights_dir(small_disk, 1))
    assert not list((small_disk / "weights").glob("*.partial"))


def _serve(model: Path, out: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "prime_rl.entrypoints.inference", "--model.name", str(model),
           "--server.port", str(port),
           "--output-dir", str(out), "--no-log.file", "--weight-transfer", "broadcast"]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240  # it starts while the module's trainer runs import torch on 2 cores
    with probe_client(timeout=1) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return server
            except httpx.TransportError:
                time.sleep(0.2)
    server.kill()
    pytest.fail(f"inference server did not start:\n{server.communicate()[0][-3000:]}")


def _greedy(url: str) -> list[float]:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "logprobs": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]["token_logprobs"]


def test_two_ranks_broadcast_step_1_and_the_server_serves_exactly_their_export_of_it(tiny_model, runs, tmp_path):
    """The trainer's side of weight_transfer = broadcast, 2 FSDP ranks each sending its own rows; the test
    plays the orchestrator (relays the trainer's announcement to the server)."""
    from prime_rl.protocol.broadcast import marker_file, read_marker

    (proc, out), port = runs["bcast"], runs["ports"]["bcast"]
    server_port = free_port()
    server = _serve(tiny_model, tmp_path / "server", server_port)
    url = f"http://127.0.0.1:{server_port}"
    try:
        deadline = time.monotonic() + 150
        while read_marker(out) is None:
            assert time.monotonic() < deadline and proc.poll() is None, _finish(proc)[1][-4000:]
            time.sleep(0.05)
        marker = read_marker(out)
        assert marker["step"] == 1 and marker_file(out, 1).is_file() and not weights_dir(out, 1).exists()
        assert marker["senders"] == 2  # each trainer rank sends its own rows: the server's seat follows theirs
        body = {"broadcast": {"host": "127.0.0.1", "port": port, "group": marker["group"], "world_size": 3,
                              "rank": 2, "senders": 2, "step": 1, "timeout": 20.0}}  # fmt: skip
        response = httpx.post(f"{url}/update_weights", json=body, timeout=60)
        assert response.status_code == 200, response.text
        broadcast = _greedy(url)
        rc, output = _finish(proc)
        assert rc == 0, output[-6000:]
        assert is_stable(weights_dir(out, 2)) and not weights_dir(out, 1).exists()  # the last step: disk only
        # The 2-rank filesystem export of the same step (runs["split"]: same data, same ranks).
        split_proc, split = runs["split"]
        assert _finish(split_proc)[0] == 0
        response = httpx.post(f"{url}/update_weights", json={"weight_dir": str(weights_dir(split, 1))}, timeout=60)
        assert response.status_code == 200, response.text
        assert _greedy(url) == broadcast
        metrics = read_metrics(out, "trainer")
        assert [m["step"] for m in metrics] == [0, 1] and "time/broadcast_weights" in metrics[0]
    finally:
        server.kill()
        server.communicate()


RECEIVER = """
import sys, time, torch
from prime_rl.protocol.broadcast import Rendezvous, ask_for, connect_store, join_group, read_marker
from prime_rl.protocol.weight_stream import receive_step
port, out, stall = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "stall"
marker, deadline = read_marker(out), time.monotonic() + 300
while marker is None or marker["group"] == sys.argv[4]:  # a group other than the one given
    if time.monotonic() > deadline:
        sys.exit(f"no weight step announced in a group other than {sys.argv[4]!r} within 300 s")
    time.sleep(0.05)
    marker = read_marker(out)
senders = marker["senders"]
rdv = Rendezvous("127.0.0.1", port, marker["group"], senders + 1, "gloo", 20.0, senders)
store = connect_store(rdv, master=False)
ask_for(store, rdv, marker["step"])
stream = receive_step(join_group(store, rdv, senders), torch.device("cpu"), lambda step, specs: None, rdv.timeout)
next(stream)  # the header
if stall:
    print(marker["group"], flush=True)
    time.sleep(3600)
print(marker["group"], sum(1 for _ in stream), flush=True)
"""


def test_a_receiver_killed_mid_broadcast_has_the_trainer_send_the_step_again_in_a_new_group(runs):
    """2 trainer ranks (each sending its own rows); the receiver takes the header and stalls, and is
    killed: the trainer gives the group up, announces step 1 again in a new group at once (not at the 20 s
    transfer timeout), sends all of it to the receiver that asks there, and finishes."""
    from prime_rl.protocol.broadcast import read_marker

    (proc, out), port = runs["stall"], runs["ports"]["stall"]

    def receiver(mode: str, not_group: str = "") -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(out), mode, not_group],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip

    stalled = receiver("stall")
    try:
        first = first_line(stalled, 300)  # the header arrived
        assert first, f"the receiver got no header ({first!r}); the trainer: {_finish(proc, 5)[1][-4000:]}"
        stalled.kill()
        killed = time.monotonic()
        while read_marker(out)["group"] == first and time.monotonic() < killed + 30:
            time.sleep(0.01)
        resent = time.monotonic() - killed  # until step 1 was announced again, in a new group
        again = receiver("all", first)
        group, tensors = again.communicate(timeout=120)[0].split()
        rc, output = _finish(proc, timeout=60)
    finally:
        stalled.kill()
        stalled.communicate()
    assert rc == 0, output[-4000:]
    print(f"receiver killed -> step 1 announced again in group {group} after {resent:.2f}s, then received")
    assert group != first and int(tensors) > 3
    assert resent < 15  # the dead peer is noticed at once, not at the configured 20 s timeout
    assert "weight broadcast of step 1 failed: " in output and f"sending it again in group {group}" in output
    assert "Traceback" not in output
    assert [m["step"] for m in read_metrics(out, "trainer")] == [0, 1]


def test_a_trainer_nobody_asks_for_its_broadcast_times_out_naming_what_it_waited_for(runs):
    proc, out = runs["lonely"]
    rc, output = _finish(proc, timeout=90)
    assert rc == 1, output[-4000:]
    assert "timed out after 3s waiting for the inference workers to ask for weight step 1" in output, output
    assert "Traceback" not in output


def test_each_rank_writes_only_its_shards_holding_at_most_its_shard_plus_one_tensor(runs):
    """No rank gathers the whole model to export it: per rank, the peak memory above its resident set before
    the export (the kernel's VmHWM) stays within its own files' bytes plus the largest tensor, and it receives
    only the other rank's rows of the tensors it writes (an all-gather brought every rank the other's half of
    every tensor)."""
    import json
    import re

    proc, out = runs["export"]
    rc, output = _finish(proc, timeout=300)
    assert rc == 0, output[-6000:]
    path = weights_dir(out, 1)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = dict(iter_safetensors(path))
    mib = {f.name: f.stat().st_size / 2**20 for f in path.glob("model-*.safetensors")}
    largest = max(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    total = sum(mib.values())
    assert set(index["weight_map"].values()) == set(mib) and len(mib) == 2
    log = (out / "logs" / "trainer.log").read_text()
    line = re.search(r"weights/step_1: per rank \[files, peak extra MiB, MiB received\]: (.*)", log)
    report = json.loads(line.group(1))
    print(f"model {total:.1f} MiB, largest tensor {largest:.1f} MiB, per rank (files, peak extra MiB, MiB "
          f"received): {report}")  # fmt: skip
    for files, peak, received in report:
        assert len(files) == 1  # its own file, and only that
        assert peak is not None and peak <= mib[files[0]] + largest, (report, mib, largest)
        assert 0 < received <= mib[files[0]] * 0.6, (report, mib)  # about half its file: the other rank's rows
    assert max(peak for _, peak, _ in report) < total / 2  # far from a full gather (which holds the whole model)
