"""A custom RL loss for `loss.type = "custom"` (tests): aipo written against the documented signature.

[trainer.loss]
type = "custom"
import_path = "custom_loss_aipo:aipo"
kwargs = { max_ratio = 1.5 }
"""

import torch

from prime_rl.trainer.rl.loss import LossInputs


def aipo(inputs: LossInputs, max_ratio: float = 8.0) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_t = −sg[min(r_t, max_ratio)] · A_t · log π_t, clipped where r_t > max_ratio."""
    ratio = inputs.log_ratio.detach().exp()
    return -ratio.clamp(max=max_ratio) * inputs.advantages * inputs.logprobs, ratio > max_ratio


def wrong_shape(inputs: LossInputs) -> torch.Tensor:
    return inputs.logprobs.sum()
