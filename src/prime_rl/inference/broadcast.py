"""The inference side of `weight_transfer = "broadcast"` (protocol.broadcast), for every backend: a worker's
seat in the trainer's broadcast group, receiving each step's tensors and checking them against the served
checkpoint's layout before anything is swapped (the trainer's side is trainer/broadcast.py).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

from prime_rl.inference.weights import WeightsError, check_specs
from prime_rl.utils.hf_layout import TensorSpecs


class BroadcastReceiver:
    """One inference worker's seat in the trainer's weight broadcast group (protocol.broadcast).

    Kept across steps (forming a group costs a round of connections, and seconds with nccl); a request for
    another group (a restarted trainer) or a failed transfer leaves the old one, so the next request joins
    afresh. Only one transfer runs at a time (the control plane serializes weight swaps).
    """

    def __init__(self) -> None:
        self.rdv = None
        self.store = None
        self.pg = None

    def receive(self, rdv, rank: int, step: int, device, served: TensorSpecs, tied: bool) -> dict:
        """Step `step`'s tensors in the sender's dtypes on `device`, checked against `served`; the served
        weights are untouched. Raises WeightsError naming the trainer when the transfer fails."""
        try:
            return dict(self.stream(rdv, rank, step, device, served, tied))
        except WeightsError as e:
            raise WeightsError(f"{e}; the previous weights keep serving") from None

    def stream(self, rdv, rank: int, step: int, device, served: TensorSpecs, tied: bool) -> Iterator:
        """(name, tensor) of step `step` as the buckets arrive, once the header was checked against `served`
        (a mismatch raises before any tensor arrives). Raises WeightsError naming the trainer when the
        transfer fails, at whatever tensor it failed."""
        from prime_rl.protocol.broadcast import BroadcastError, GivenUp, ask_for, connect_store, join_group
        from prime_rl.protocol.weight_stream import receive_step

        def check(got_step: int, specs: dict) -> None:
            if got_step != step:
                raise WeightsError(f"the trainer sent weight step {got_step}, the request named {step}")
            check_specs({n: (shape, dtype.is_floating_point) for n, (shape, dtype) in specs.items()}, served, tied)

        try:
            if self.rdv != rdv:
                self.leave()
                self.store = connect_store(rdv, master=False)
                self.rdv = rdv
            ask_for(self.store, rdv, step)
            given_up = GivenUp(rdv, step)  # the trainer forms a new group when the seats changed: no waiting it out
            if self.pg is None:
                self.pg = join_group(self.store, rdv, rank, given_up)
            stream = receive_step(self.pg, device, check, rdv.timeout, given_up)
            next(stream)  # the checked header
            yield from stream
        except WeightsError as e:  # the header does not fit the served model: the transfer is abandoned
            self.fail(rdv, step, f"seat {rank}: {e}")
            raise
        except BroadcastError as e:
            message = f"weight broadcast of step {step} from the trainer at {rdv.where} failed ({e})"
            self.fail(rdv, step, f"seat {rank}: {message}")
            raise WeightsError(f"{message}; is the trainer alive?") from None
        except (RuntimeError, OSError) as e:  # the store client: the trainer went away
            self.leave()
            message = f"weight broadcast of step {step}: lost the trainer's rendezvous at {rdv.where}: {e}"
            raise WeightsError(message) from None

    def fail(self, rdv, step: int, reason: str) -> None:
        """Tell the trainer why this seat's transfer failed (it forms a new group at once), then leave."""
        from prime_rl.protocol.broadcast import report_failure

        if self.store is not None:
            report_failure(self.store, rdv, step, reason)
        self.leave()
        gc.collect()  # an exception's frames may still hold the group: its sockets close now, not at some later GC

    def leave(self) -> None:
        from prime_rl.protocol.weight_stream import abandon

        abandon(self.pg)  # nccl: no kernel stays stuck on the old communicator
        self.rdv = self.store = self.pg = None  # dropping the handles closes the connections
