"""SFT's held-out loss: the mean negative log-likelihood per completion token of rows the run never trains on,
the same quantity as the training loss, so the two curves share an axis.

Every rank scores its share of the rows (every world_size-th sample) and the sums are reduced, so the
figure does not depend on the rank count beyond the last bits of float addition.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from prime_rl.configs.sft import SFTDataConfig, SFTValConfig
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.logprobs import sample_starts
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.parallel import Dist, all_reduce
from prime_rl.trainer.prefix import policy_output, shared_row
from prime_rl.trainer.sft.data import build_samples, pack_rank_rows
from prime_rl.utils.timer import timer


def build_val_rows(
    data: SFTDataConfig, seq_len: int, tokenizer: PreTrainedTokenizerBase, dist: Dist, share_prompts: bool = False
) -> list[MicroBatch]:
    """This rank's packed held-out rows of `data` (`val.data`) in rows of `seq_len` (collective: as many rows
    on every rank; `share_prompts`: packed as a trainer sharing prompts computes them, as the training rows)."""
    try:
        samples, _ = build_samples(data, tokenizer, seq_len)
    except TrainerError as e:  # its messages name `data.…`: say which data
        raise TrainerError(f"held-out rows (val.data): {e}") from None
    return pack_rank_rows(samples[dist.rank :: dist.world_size], seq_len, dist, share_prompts)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, rows: list[MicroBatch], dist: Dist, share_prompts: bool = False) -> float:
    """Σ −log π(completion tokens) / N over all ranks' held-out rows (collective; `share_prompts`: each row's
    shared prompts computed once, trainer/prefix.py)."""
    nll, count = 0.0, 0
    for mb in rows:
        mask = (mb.loss_mask & ~sample_starts(mb)).to(dist.device)
        out = policy_output(model, mb, dist.device, mask, False, shared_row(mb, mask) if share_prompts else None)
        nll += float(torch.where(mask, -out.logprobs, 0.0).sum())
        count += int(mask.sum())
    total, n = all_reduce([nll, count], dist.device)
    return total / max(n, 1)


def evaluate_if_due(
    val: SFTValConfig | None,
    model: torch.nn.Module,
    rows: list[MicroBatch] | None,
    dist: Dist,
    step: int,
    max_steps: int,
    times: dict,
    share_prompts: bool = False,
) -> dict:
    """`{"val/loss": …}` after the steps `[val]` asks for (every `interval`-th and the last), else `{}` (and
    always without `[val]`: no rows)."""
    if val is None or rows is None or (step % val.interval and step != max_steps):
        return {}
    with timer(times, "val"):
        return {"val/loss": held_out_loss(model, rows, dist, share_prompts)}


def target_reached(val: SFTValConfig | None, measured: dict) -> bool:
    """The evaluation just made (`measured`, from evaluate_if_due) is below `val.stop_below`: the run ends here."""
    return bool(measured) and val is not None and val.stop_below is not None and measured["val/loss"] < val.stop_below
