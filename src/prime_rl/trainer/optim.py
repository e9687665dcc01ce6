"""The optimizer (fused AdamW, or Muon + AdamW) and its learning-rate schedule, shared by the RL trainer and SFT.

With `optim.type = "muon"` the 2-D weight matrices of the decoder layers take torch's Muon (momentum, then
the update orthogonalized by a Newton–Schulz iteration) and everything else (embeddings, head, norms,
biases) takes fused AdamW: the usual split, as Muon is made for hidden-layer matrices. The two are one
`MultiOptimizer`, so the trainers, the lr schedule and checkpoints see a single optimizer.

Under FSDP2 a weight is a DTensor holding rows of the matrix (Shard(0)). Torch's Muon runs on one as DTensor
ops: the same math (in float64 equal to 1e-15), but its bf16 matmuls then sum partial products across ranks
in bf16, so the update is rounded differently (on the tiny test model by up to 21% of a matrix's update in
norm, as much as bf16 Newton–Schulz itself differs from float64's) and a run depends on its world size.
`Muon` here gathers each update matrix, orthogonalizes the whole of it on every rank and keeps this rank's
rows: bitwise the unsharded update, at one all-gather per matrix (every rank computes every matrix).
Only parameters with `requires_grad` are optimized (LoRA freezes the base model).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from prime_rl.configs.training import OptimConfig
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.parallel import decoder_layers


def build_optimizer(model: torch.nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with the fused kernel (one pass over all parameters, CPU and CUDA; ~3x faster than per-tensor),
    or with `o.type = "muon"` Muon for the decoder layers' matrices and fused AdamW for the rest."""

    def adamw(params: list[torch.Tensor]) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=True)

    trainable = [p for p in model.parameters() if p.requires_grad]
    if o.type == "adamw":
        return adamw(trainable)
    matrices = {p for layer in decoder_layers(model) for p in layer.parameters() if p.requires_grad and p.ndim == 2}
    if not matrices:
        raise TrainerError("optim.type = 'muon' but the decoder layers have no trainable 2-D weights; use adamw")
    optimizers = [
        Muon(
            [p for p in trainable if p in matrices],
            lr=o.lr if o.muon_lr is None else o.muon_lr,
            weight_decay=o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay,
            momentum=o.muon_momentum,
            nesterov=o.muon_nesterov,
            ns_steps=o.muon_ns_steps,
            adjust_lr_fn=o.muon_adjust_lr_fn,
        )
    ]
    rest = [p for p in trainable if p not in matrices]
    if rest:  # LoRA trains only matrices inside the decoder layers
        optimizers.append(adamw(rest))
    return MultiOptimizer(optimizers)


def evaluate(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """An optimizer step's closure, evaluated with gradients on (torch's contract; the trainers pass none)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Muon(torch.optim.Muon):
    """torch's Muon, whose step also orthogonalizes DTensor (FSDP-sharded) updates as whole matrices.

    The step is torch 2.11's `_single_tensor_muon` line for line (so a plain tensor's update is bitwise
    torch's), with `_orthogonalize` in place of the Newton–Schulz call.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = evaluate(closure)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = _orthogonalize(update, group)
                weight = p.to_local() if isinstance(p, DTensor) else p  # this rank's rows, updated in place
                weight.mul_(1 - lr * group["weight_decay"])
                weight.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def _orthogonalize(update: torch.Tensor, group: dict) -> torch.Tensor:
    """Newton–Schulz of `update`; of a DTensor, this rank's shard of the whole matrix's result (a plain tensor)."""

    def newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
        return _zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

    if not isinstance(update, DTensor):
        return newton_schulz(update)
    # Newton–Schulz needs the whole matrix: gather it on the mesh's device (`from_local` moves the shard there:
    # with CPU offload it lives in host memory), orthogonalize it on every rank, keep this rank's rows.
    mesh, placements, local = update.device_mesh, update.placements, update.to_local()
    full = DTensor.from_local(local, mesh, placements, shape=update.shape, stride=update.stride()).full_tensor()
    shard = distribute_tensor(newton_schulz(full), mesh, placements, src_data_rank=None)
    return shard.to_local().to(local.device)


class MultiOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters as one: `step`, `zero_grad`, `param_groups` (so one lr
    scheduler drives every group), `state_dict` / `load_state_dict` (so DCP checkpoints it as one).

    The children keep their own `step`; their param groups are this optimizer's group dicts and their
    state is this optimizer's state dict, re-linked whenever `load_state_dict` replaces both.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        super().__init__([group for opt in optimizers for group in opt.param_groups], {})
        self._link()

    def _link(self) -> None:
        groups = iter(self.param_groups)
        for opt in self.optimizers:
            opt.param_groups = [next(groups) for _ in opt.param_groups]
            opt.state = self.state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = evaluate(closure)
        for opt in self.optimizers:
            opt.step()
        return loss


def lr_factor(step: int, o: OptimConfig, max_steps: int) -> float:
    """Multiplier of `o.lr` for optimizer step `step` (0-based).

    Example (warmup 2, max_steps 6, linear): warmup (step + 1) / 2, then 1 − (step − 2) / 4 over the remaining
    4 steps → steps 0..5 use [0.5, 1, 1, 0.75, 0.5, 0.25].
    """
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.scheduler == "constant":
        return 1.0
    progress = (step - o.warmup_steps) / max(max_steps - o.warmup_steps, 1)
    if o.scheduler == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, o: OptimConfig, max_steps: int):
    """`lr_factor` applied to every param group's own peak lr (AdamW's and Muon's alike)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, o, max_steps))
