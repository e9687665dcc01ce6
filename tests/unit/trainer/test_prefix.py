"""Shared prompts computed once (trainer/prefix.py): the row laid out again, and the same logprobs, loss and update
as the row as packed."""

import copy

import pytest
import torch

from prime_rl.configs.shared import LoraConfig
from prime_rl.configs.trainer import TrainerConfig
from prime_rl.protocol.packing import packed_rows
from prime_rl.trainer.logprobs import sample_starts
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.model import build_model
from prime_rl.trainer.optim import build_optimizer
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.prefix import policy_output, shared_row, shares_prompts
from prime_rl.trainer.rl.train import train_step
from prime_rl.utils.tiny_model import create_tiny_model
from tests.samples import on_policy_sample, sample


def test_a_group_s_prompt_is_laid_out_once_and_its_members_attend_to_it():
    """Two samples share p = [5, 6, 7] (loss from their 4th token), a third has its own prompt."""
    mb = MicroBatch.pack(
        [
            sample([5, 6, 7, 10], 3, env=0),
            sample([9, 9, 1, 2], 2, env=1),
            sample([5, 6, 7, 20, 21], 3, env=1, kept=[[], [], [], [4, 5], []], policy_steps=[-1, -1, -1, 3, 3]),
        ],
        temperature=1.0,
        env_names=["a", "b"],
    )
    shared = shared_row(mb, mb.loss_mask)
    # The prompt's tokens before the last one once; each member keeps the last (7), whose logits predict its first.
    assert shared.mb.input_ids.tolist() == [[5, 6, 7, 10, 7, 20, 21, 9, 9, 1, 2]]
    assert shared.mb.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4, 0, 1, 2, 3]]
    assert shared.mb.cu_seqlens.tolist() == [0, 2, 4, 7, 11]
    assert shared.kv_index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10]
    assert shared.cu_seqlens_k.tolist() == [0, 2, 6, 11, 15]
    assert shared.mb.sample_env.tolist() == [0, 0, 1, 1]
    assert shared.where.tolist() == [[False, False, False, True, False, True, True, False, False, True, True]]
    assert shared.index.tolist() == [0, 1, 2, 3, 10, 11, 12, 4, 5, 6, 7]
    # Every per-token field follows its token: the kept set of 20's successor, the policy steps.
    assert shared.mb.policy_steps.tolist() == [[-1, -1, -1, -1, -1, 3, 3, -1, -1, -1, -1]]
    assert shared.mb.kept_offsets.tolist() == [0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2]
    assert shared.mb.kept_ids.tolist() == [4, 5] and shared.mb.kept_ids.dtype == torch.int32
    shared.mb.validate()
    # Only the last prompt token differs: the rest is shared. Prompts that part earlier share their common start
    # (a system prompt); with none, nothing is, and the row stays as it is.
    last = MicroBatch.pack([sample([5, 6, 7, 10], 3), sample([5, 6, 8, 10], 3)], 1.0)
    assert shared_row(last, last.loss_mask).mb.input_ids.tolist() == [[5, 6, 7, 10, 8, 10]]
    part = MicroBatch.pack([sample([5, 6, 7, 10], 3), sample([5, 9, 7, 10], 3)], 1.0)
    start = shared_row(part, part.loss_mask)
    assert start.mb.input_ids.tolist() == [[5, 6, 7, 10, 9, 7, 10]]
    assert start.kv_index.tolist() == [0, 0, 1, 2, 3, 0, 4, 5, 6]
    apart = MicroBatch.pack([sample([5, 6, 7, 10], 3), sample([4, 6, 7, 10], 3)], 1.0)
    assert shared_row(apart, apart.loss_mask) is None


def test_groups_that_open_with_one_system_prompt_share_it_as_a_second_level():
    """Prompts s s p p (two samples), s s q (two) and s s (one): s s once, p p and q once for their groups, each
    sample's own tokens attending to every start above it."""
    s, p, q = [3, 4], [5, 6], [7]
    mb = MicroBatch.pack(
        [sample(s + p + [8, 1], 5), sample(s + q + [8, 2], 4), sample(s + p + [8, 3, 3], 5),
         sample(s + q + [8, 4], 4), sample(s + [9, 5], 3)],
        temperature=1.0,
    )  # fmt: skip
    shared = shared_row(mb, mb.loss_mask)
    # s s | p p | 8 1 | 8 3 3 | 7 | 8 2 | 8 4 | 9 5: each sample keeps the token before its first loss token (8,
    # 9); the q group's start past s s is its 7.
    assert shared.mb.input_ids.tolist() == [[3, 4, 5, 6, 8, 1, 8, 3, 3, 7, 8, 2, 8, 4, 9, 5]]
    assert shared.mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 4, 5, 6, 2, 3, 4, 3, 4, 2, 3]]
    keys, cu_k = shared.kv_index.tolist(), shared.cu_seqlens_k.tolist()
    assert [keys[a:b] for a, b in zip(cu_k, cu_k[1:], strict=False)] == [
        [0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 7, 8],
        [0, 1, 9], [0, 1, 9, 10, 11], [0, 1, 9, 12, 13], [0, 1, 14, 15],
    ]  # fmt: skip
    assert shared.mb.num_tokens == 16 < mb.num_tokens == 27
    shared.mb.validate()


def _groups(model, seed: int) -> MicroBatch:
    """Three groups of completions of three prompts, as an RL step packs them, with one lone sample between; the
    first three prompts open with one system prompt (a tree of two levels)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 1000, (4,), generator=g).tolist()
    samples = []
    for prompt_len, size in ((9, 4), (5, 1), (14, 3), (1, 3)):
        own = torch.randint(3, 1000, (prompt_len,), generator=g).tolist()
        prompt = system + own[len(system) :] if prompt_len > len(system) else own
        for _ in range(size):
            completion = torch.randint(3, 1000, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            advantage = float(torch.randn(1, generator=g))
            samples.append(on_policy_sample(model, prompt + completion, prompt_len, advantage, shift=0.1))
    perm = torch.randperm(len(samples), generator=g).tolist()  # members need not be neighbours
    return MicroBatch.pack([samples[i] for i in perm], temperature=0.7)


@pytest.mark.parametrize("seed", range(4))
def test_rows_packed_counting_shared_prompts_once_compute_at_most_seq_len_tokens(seed):
    """The orchestrator's share_prompts packing (protocol/packing.py) and this layout agree, a system prompt
    shared across groups included: each row's computed tokens are what the packer counted, so none exceeds
    seq_len, while the rows hold more samples."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 1000, (8,), generator=g).tolist()  # half the prompts open with it
    samples = []
    for p in range(6):
        prompt = torch.randint(3, 1000, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
        prompt = system + prompt if p % 2 else prompt
        for _ in range(int(torch.randint(1, 9, (1,), generator=g))):
            completion = torch.randint(3, 1000, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
            samples.append(sample(prompt + completion.tolist(), len(prompt)))
    seq_len = 96
    bins, sizes = packed_rows(samples, seq_len, share_prompts=True)
    assert len(bins) < len(packed_rows(samples, seq_len)[0])
    for b, size in zip(bins, sizes, strict=True):
        mb = MicroBatch.pack([samples[i] for i in b], temperature=1.0)
        shared = shared_row(mb, mb.loss_mask & ~sample_starts(mb))
        computed = mb.num_tokens if shared is None else shared.mb.num_tokens
        assert computed == size <= seq_len


@pytest.mark.parametrize(
    ("seed", "kind"), [(0, "qwen3"), (1, "qwen3"), (2, "qwen3"), (0, "lora"), (0, "qwen3_moe"), (0, "llama")]
)
def test_shared_prompts_give_the_same_logprobs_and_gradients(tiny_model, tmp_path, seed, kind):
    """Over seeds; through a LoRA adapter (peft's forward), an MoE's (routing per token) and Llama's attention."""
    if kind in ("qwen3", "lora"):
        lora = LoraConfig(rank=4, alpha=8) if kind == "lora" else None
        model = build_model(str(tiny_model), lora=lora)
    else:
        model = build_model(str(create_tiny_model(tmp_path / kind, kind)))
    cpu = torch.device("cpu")
    assert shares_prompts(model, cpu)
    mb = _groups(model, seed)
    where = mb.loss_mask
    shared = shared_row(mb, where)
    assert shared is not None and shared.mb.num_tokens < mb.num_tokens
    results = []
    for share in (False, True):
        model.zero_grad()
        out = policy_output(model, mb, cpu, where, True, shared if share else None)
        (out.logprobs * mb.advantages + 0.01 * out.entropy).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((out.logprobs.detach(), out.entropy.detach(), grads))
    (lp, ent, grads), (lp_shared, ent_shared, grads_shared) = results
    torch.testing.assert_close(lp_shared[where], lp[where], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_shared[where], ent[where], atol=1e-5, rtol=0)
    for got, want in zip(grads_shared, grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_step_with_shared_prompts_reports_and_updates_as_one_without(tiny_model, tmp_path, one_rank):
    runs = []
    base = build_model(str(tiny_model))
    mbs = [_groups(base, 3), _groups(base, 4)]
    for share in (False, True):
        config = TrainerConfig(model={"name": str(tiny_model)}, output_dir=tmp_path, optim={"lr": 1e-3},
                               share_prompts=share)  # fmt: skip
        model = copy.deepcopy(base)
        apply_fsdp(model, one_rank, torch.float32)
        stats = train_step(model, build_optimizer(model, config.optim), mbs, config, one_rank)
        runs.append((stats, [p.detach().clone() for p in model.parameters()]))
    (plain, plain_weights), (shared, shared_weights) = runs
    assert (shared.num_tokens, shared.num_loss_tokens, shared.num_samples) == (
        plain.num_tokens, plain.num_loss_tokens, plain.num_samples,
    )  # fmt: skip
    assert plain.num_computed_tokens == plain.num_tokens > shared.num_computed_tokens
    assert shared.loss == pytest.approx(plain.loss, abs=1e-6)
    assert shared.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    for key, value in plain.means.items():
        assert shared.means[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # AdamW moves a weight by ~lr whatever its gradient's size, so a gradient near 0 (1e-9 against 2e-9, float
    # summation order) can move it differently: within a tenth of that step, and all but a few within 1e-6.
    for got, want in zip(shared_weights, plain_weights, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert int(((got - want).abs() > 1e-6).sum()) <= max(2, got.numel() // 1000)


def test_sft_rows_packed_as_the_trainer_computes_them_hold_more_samples_and_train_the_same_loss(tiny_model, one_rank):
    """SFT packs a batch counting its shared system prompt once (sft/data.py `pack_rank_rows` with share_prompts,
    as sft/train.py does where the trainer shares): fewer rows, none computing more than seq_len, the same loss,
    held-out loss and gradient norm as the rows packed whole."""
    from prime_rl.trainer.sft.data import pack_rank_rows
    from prime_rl.trainer.sft.train import nll_loss
    from prime_rl.trainer.sft.val import held_out_loss
    from prime_rl.trainer.step import train_step as sft_step

    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 1000, (24,), generator=g).tolist()
    samples = []
    for _ in range(12):
        prompt = system + torch.randint(3, 1000, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
        answer = torch.randint(3, 1000, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        samples.append(sample(prompt + answer, len(prompt)))
    seq_len = 96
    base, runs, held_out = build_model(str(tiny_model)), [], []
    for share in (False, True):
        rows = pack_rank_rows(samples, seq_len, one_rank, share_prompts=share)
        model = copy.deepcopy(base)
        apply_fsdp(model, one_rank, torch.float32)
        optimizer = build_optimizer(model, TrainerConfig(model={"name": str(tiny_model)}).optim)
        held_out.append(held_out_loss(model, rows, one_rank, share))  # sft/val.py, as the held-out rows are scored
        runs.append(sft_step(model, optimizer, rows, one_rank, nll_loss, 1.0, share_prompts=share))
    plain, shared = runs
    assert held_out[1] == pytest.approx(held_out[0], abs=1e-5)
    assert shared.num_rows < plain.num_rows and plain.num_rows == len(pack_rank_rows(samples, seq_len, one_rank))
    assert shared.num_computed_tokens <= seq_len * shared.num_rows
    assert shared.num_samples == plain.num_samples == 12 and shared.num_loss_tokens == plain.num_loss_tokens
    assert shared.loss == pytest.approx(plain.loss, abs=1e-5)
    assert shared.grad_norm == pytest.approx(plain.grad_norm, rel=1e-4)
