"""The weight group's failure handling (protocol/broadcast.py, protocol/weight_stream.py): on nccl the group is created
so that a dead peer is an error of this process, not its end, and every collective is waited for on the host for at
most the transfer timeout; a failed send still walks every tensor (the trainer's ranks gather in lockstep).

NCCL needs a GPU: the nccl tests replace torch's ProcessGroupNCCL constructor (and, on a torch built without it, its
Options) by a recorder, and a work that never completes by a stand-in; the gloo test runs real groups."""

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from prime_rl.protocol import broadcast, weight_stream
from prime_rl.protocol.broadcast import BroadcastError, Rendezvous, join_group
from prime_rl.protocol.weight_stream import receive_step, send_step, wait_for_work
from prime_rl.utils.net import free_port


class RecordedNCCL:
    """Stands in for dist.ProcessGroupNCCL (no GPU here): records what the group was created with."""

    made: list[dict] = []
    Options = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)

    def __init__(self, store, rank, size, options):
        env = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        RecordedNCCL.made.append({"rank": rank, "size": size, "timeout": options._timeout, "env": env})


class FakeOptions:
    _timeout = None


@pytest.mark.parametrize("before", [None, "1"])
def test_the_nccl_weight_group_takes_the_transfer_timeout_and_aborts_instead_of_ending_the_process(monkeypatch, before):
    """Mode 2 (CleanUpOnly) while the group is created, read by torch's constructor; the setting before comes
    back afterwards (the trainer's own groups keep it)."""
    if RecordedNCCL.Options is None:  # a torch built without NCCL: its Options are a plain holder too
        monkeypatch.setattr(RecordedNCCL, "Options", FakeOptions)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordedNCCL, raising=False)
    if before is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", before)
    RecordedNCCL.made.clear()
    store = dist.HashStore()
    join_group(store, Rendezvous("127.0.0.1", 1, "g", 3, "nccl", 7.0), 2)
    assert RecordedNCCL.made == [{"rank": 2, "size": 3, "timeout": timedelta(seconds=7), "env": "2"}]
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == before


class NeverDone:
    """A work whose peer died with nothing to notice it (nccl: a kernel waiting for it forever)."""

    def __init__(self):
        self.waited = False

    def is_completed(self) -> bool:
        return False

    def wait(self):
        self.waited = True


class Group:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


def test_a_collective_that_never_completes_is_a_timeout_naming_it_and_the_group_is_aborted():
    work, pg = NeverDone(), Group()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^bucket 3 of weight step 5 did not complete within 0.3s"):
        wait_for_work(work, pg, 0.3, "bucket 3 of weight step 5")
    assert 0.3 <= time.monotonic() - start < 1.5
    assert pg.aborted == 1 and not work.waited  # wait() would block the host forever on nccl
    with pytest.raises(BroadcastError):  # callers that catch BroadcastError catch it too
        wait_for_work(work, pg, 0.01, "x")


class StuckAbort(Group):
    """A group whose abort blocks (NCCL's waits for work queued ahead on the stream: seen on an H200, a GPU
    cannot be had here, so the blocking abort is simulated)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def abort(self):
        super().abort()
        self.release.wait(60)


def test_a_timeout_is_raised_within_the_abort_grace_even_when_the_abort_blocks(monkeypatch):
    monkeypatch.setattr(weight_stream, "ABORT_GRACE", 0.5)
    work, pg = NeverDone(), StuckAbort()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not complete within 0.2s"):
        wait_for_work(work, pg, 0.2, "bucket 1 of weight step 2")
    assert 0.7 <= time.monotonic() - start < 2.0 and pg.aborted == 1
    pg.release.set()


def gloo_group(size: int, timeout: float) -> tuple[list, list]:
    """`size` gloo ranks of one group in this process (threads): their groups, and the stores to keep alive."""
    port = free_port()
    rdv = Rendezvous("127.0.0.1", port, "g", size, "gloo", timeout)
    stores = [dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)]
    stores += [dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10)) for _ in range(size - 1)]
    groups = {}
    threads = [threading.Thread(target=lambda r, s: groups.update({r: join_group(s, rdv, r)}), args=(r, s))
               for r, s in enumerate(stores)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [groups[r] for r in range(size)], stores


def gloo_pair(timeout: float):
    (sender, receiver), stores = gloo_group(2, timeout)
    return sender, receiver, stores


def test_a_send_whose_receiver_left_raises_at_once_after_walking_every_tensor():
    sender, receiver, stores = gloo_pair(timeout=20)
    specs = [(f"w{i}", torch.float32, (2**20,)) for i in range(4)]  # 4 MiB each, a bucket of 16 MiB
    walked, got, holder = [], {}, {"pg": receiver}
    del receiver

    def tensors():
        for i, (_, dtype, shape) in enumerate(specs):
            walked.append(i)
            yield torch.full(shape, float(i), dtype=dtype)

    def receive_the_header_then_leave():
        stream = receive_step(holder["pg"], torch.device("cpu"), lambda step, specs: None, 20)
        got["header"] = next(stream)
        stream.close()
        del stream
        holder.pop("pg")  # the group's last reference: its sockets close, as when a server dies

    thread = threading.Thread(target=receive_the_header_then_leave)
    thread.start()
    start = time.monotonic()
    with pytest.raises(BroadcastError):
        send_step(sender, 4, specs, tensors(), torch.device("cpu"), 20)
    thread.join(30)
    assert got["header"] == (4, None)
    assert time.monotonic() - start < 10  # noticed at once, not at the 20 s timeout
    assert walked == [0, 1, 2, 3]  # every tensor was still gathered (other trainer ranks gather with rank 0)
    del stores


def test_wait_for_work_raises_the_peers_error_once_the_work_completes():
    sender, receiver, _ = gloo_pair(timeout=2)
    work = receiver.broadcast(torch.zeros(3), 0)
    sender = None  # noqa: F841 (dropping the sender's group closes its sockets: the receiver's work fails)
    with pytest.raises(RuntimeError, match="Connection (closed|reset) by peer"):
        wait_for_work(work, receiver, 10, "the header")


def test_environment_restores_what_was_there(monkeypatch):
    monkeypatch.setenv("A_SET", "x")
    monkeypatch.delenv("A_UNSET", raising=False)
    with broadcast.environment({"A_SET": "y", "A_UNSET": "z"}):
        assert os.environ["A_SET"] == "y" and os.environ["A_UNSET"] == "z"
    assert os.environ["A_SET"] == "x" and "A_UNSET" not in os.environ


def test_a_step_in_many_buckets_arrives_exactly_while_the_next_bucket_is_on_the_wire(monkeypatch):
    """Sender and receiver each keep one bucket in flight (gathering, or loading, the other): every tensor of
    every dtype still arrives whole and in order, with a slow loader on the receiving side."""
    monkeypatch.setattr(weight_stream, "BUCKET_BYTES", 4096)
    sender, receiver, stores = gloo_pair(timeout=20)
    gen = torch.Generator().manual_seed(0)
    sent = {f"t{i}": torch.randn(1 + 97 * i, generator=gen).to(dtype) for i, dtype in
            enumerate([torch.float32, torch.bfloat16, torch.float32, torch.int64] * 6)}  # fmt: skip
    sent["t3"] = torch.arange(300)  # int64: its own buckets
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in sent.items()]
    assert len(weight_stream.buckets(specs)) > 12
    got = {}

    def receive():
        for name, tensor in receive_step(receiver, torch.device("cpu"), lambda step, specs: None, 20):
            if tensor is not None:
                time.sleep(0.002)  # a server loading it
                got[name] = tensor.clone()

    thread = threading.Thread(target=receive)
    thread.start()
    send_step(sender, 1, specs, iter(sent.values()), torch.device("cpu"), 20)
    thread.join(30)
    assert list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    del stores


def test_three_senders_each_send_their_own_rows_and_two_seats_get_every_tensor_whole(monkeypatch):
    """Every trainer rank sends its rows of each tensor (uneven, some none, a scalar and a tensor of rank 0 alone)
    in buckets small enough that pieces of several senders make up each; both seats get every tensor exactly,
    and the senders' row checksums summed are the whole tensors' checksum."""
    from prime_rl.protocol.parity import RowSums, checksum_of

    monkeypatch.setattr(weight_stream, "BUCKET_BYTES", 256)
    groups, stores = gloo_group(5, timeout=20)
    gen = torch.Generator().manual_seed(1)
    sent = {
        "a": (torch.randn(7, 3, generator=gen), [3, 3, 1]),
        "b": (torch.randn(5, generator=gen), [0, 0, 5]),
        "c": (torch.tensor(2.5), [1, 0, 0]),
        "d": (torch.arange(40).reshape(10, 4), [4, 4, 2]),  # int64: buckets of its own
        "e": (torch.randn(64, 2, generator=gen).to(torch.bfloat16), [22, 22, 20]),
        "f": (torch.randn(0, 3, generator=gen), [0, 0, 0]),
    }
    specs = [(n, t.dtype, tuple(t.shape)) for n, (t, _) in sent.items()]
    rows = [split for _, split in sent.values()]
    got, sums, errors = {3: {}, 4: {}}, [], []

    def sender(rank: int) -> None:
        s = RowSums(torch.device("cpu"))
        pieces = []
        for (name, (t, split)), (_, dtype, shape) in zip(sent.items(), specs, strict=True):
            first = sum(split[:rank])
            mine = t[first : first + split[rank]] if t.dim() else t if rank == 0 else t[None][:0]
            s.add(name, dtype, shape, mine, first)
            pieces.append(mine)
        try:
            send_step(groups[rank], 3, specs, pieces, torch.device("cpu"), 20, rows, rank)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        sums.append(s)

    def seat(rank: int) -> None:
        for name, tensor in receive_step(groups[rank], torch.device("cpu"), lambda step, specs: None, 20):
            if tensor is not None:
                got[rank][name] = tensor.clone()

    threads = [threading.Thread(target=sender, args=(r,)) for r in range(3)]
    threads += [threading.Thread(target=seat, args=(r,)) for r in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    for seat_rank in (3, 4):
        assert list(got[seat_rank]) == list(sent)
        for name, (tensor, _) in sent.items():
            received = got[seat_rank][name]
            assert received.dtype == tensor.dtype and received.shape == tensor.shape, name
            assert torch.equal(received, tensor), name
    summed = torch.stack([torch.stack(s.values) for s in sums]).sum(dim=0)  # the trainer's all-reduce
    combined = sums[0].checksum(lambda values: summed)
    assert combined.hex == checksum_of((n, t) for n, (t, _) in sent.items()).hex and combined.tensors == len(sent)
    del stores


def test_a_look_for_a_given_up_group_at_a_dying_trainers_store_returns_within_seconds():
    """A seat's look (GivenUp) that connects while the trainer's store dies: the port accepts, then resets each
    connection (a killed process's listening socket). Its store client retries for its own timeout, not the
    transfer's: before, 67 s at a 30 s transfer timeout (a seat's update answered a minute late, seen in CI)."""
    import socket
    import struct

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def reset_each():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=reset_each, daemon=True).start()
    look = broadcast.GivenUp(Rendezvous("127.0.0.1", listener.getsockname()[1], "g", 2, "gloo", 30.0), 1)
    start = time.monotonic()
    assert look() is None  # the store went: the group's own wait says so
    assert time.monotonic() - start < 6
    listener.close()


@pytest.mark.parametrize(
    ("tensors", "senders", "said"),
    [
        ([["w", "float32", [4, 2], [3, 0]]], 2, "rows [3, 0] of 2 sender(s) do not make shape [4, 2]"),
        ([["w", "float32", [4, 2], [2, 2, 0]]], 2, "rows [2, 2, 0] of 2 sender(s)"),
        ([["w", "float32", [4, 2], [5, -1]]], 2, "rows [5, -1] of 2 sender(s)"),
        ([["w", "complex64", [4]]], 1, "w: unknown dtype or negative size"),
        ([["w", "float32", [-4]]], 1, "w: unknown dtype or negative size"),
        ([["w", "float32"]], 1, "malformed weight header"),
        ([], 0, "0 senders"),
    ],
)
def test_a_malformed_weight_header_is_refused_naming_the_fault_before_any_tensor_is_awaited(tensors, senders, said):
    """A header whose rows do not make its shapes (or any other fault) ends the receive at once with the reason:
    never a wait for bytes no sender will send, nor tensors put together wrong."""
    import json

    sender, receiver, stores = gloo_pair(timeout=20)
    raw = json.dumps({"step": 3, "senders": senders, "tensors": tensors}).encode()
    size, body = torch.tensor([len(raw)], dtype=torch.int64), torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    sent = threading.Thread(target=lambda pg=sender: [pg.broadcast(t, 0).wait() for t in (size, body)])
    sent.start()
    start = time.monotonic()
    with pytest.raises(BroadcastError, match="malformed weight header") as refused:
        next(receive_step(receiver, torch.device("cpu"), lambda step, specs: None, 20))
    sent.join(10)
    assert said in str(refused.value)
    assert time.monotonic() - start < 5  # at once, not at the 20 s timeout
    del sender, receiver, stores
