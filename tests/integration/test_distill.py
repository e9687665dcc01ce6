"""On-policy distillation end to end: `rl` starts a teacher server beside the policy server, the orchestrator
scores every rollout with it, and the rank files carry A_t = reward_weight · A_env + kl_coef · (log p_T − log μ)."""

import subprocess
import sys

import pytest
import torch

from prime_rl.protocol import rank_file
from prime_rl.protocol.records import read_rank_file
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.model import build_model
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port as another_free_port

pytestmark = pytest.mark.slow


def test_rl_with_a_teacher_records_teacher_kl_and_trains_on_the_distillation_advantage(
    tiny_model, tiny_qwen3_hd32, tmp_path, free_port
):
    """Student: the tiny Qwen3 (hidden 64); teacher: a larger one with the same tokenizer (hidden 128)."""
    out, teacher_port = tmp_path / "out", another_free_port()
    args = [
        "--model.name", str(tiny_model), "--output-dir", str(out), "--max-steps", "2", "--async-level", "0",
        "--inference.server.port", str(free_port), "--orchestrator.batch-size", "8",
        "--orchestrator.rollouts-per-example", "4", "--orchestrator.seq-len", "128",
        "--orchestrator.sampling.max-tokens", "8", "--teacher.model.name", str(tiny_qwen3_hd32),
        "--teacher.server.port", str(teacher_port), "--teacher.max-model-len", "256",
        "--orchestrator.teacher.kl-coef", "0.5", "--orchestrator.teacher.reward-weight", "0.5",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.entrypoints.rl", *args], capture_output=True, text=True, timeout=180
    )
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.log")))
    assert result.returncode == 0, result.stderr[-3000:] + logs
    assert f"teacher {tiny_qwen3_hd32} ready on port {teacher_port}" in result.stderr
    assert "serving" in (out / "logs" / "teacher.log").read_text()
    orch = read_metrics(out, "orchestrator")
    assert [m["step"] for m in orch] == [0, 1] and all("teacher_kl" in m for m in orch), orch

    # Step 1 read back: on each sample's model tokens, A_t - 0.5 (log p_T - log μ) is one constant, the rollout's
    # 0.5 · A_env (|A_env| <= 1: rewards are in [0, 1]); log p_T is the trainer's on the teacher model. The
    # step's teacher_kl is the mean of log μ - log p_T over those tokens.
    teacher_model, gaps = build_model(str(tiny_qwen3_hd32)), []
    for mb in read_rank_file(rank_file(out, 1, 0), 1, 0):
        for start, end in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist(), strict=True):
            one = type(mb)(
                input_ids=mb.input_ids[:, start:end], position_ids=torch.arange(end - start)[None],
                cu_seqlens=torch.tensor([0, end - start], dtype=torch.int32), loss_mask=mb.loss_mask[:, start:end],
                advantages=mb.advantages[:, start:end], inference_logprobs=mb.inference_logprobs[:, start:end],
                temperature=1.0,
            )  # fmt: skip
            with torch.no_grad():
                teacher = forward_logprobs(teacher_model, one, torch.device("cpu")).logprobs[0]
            model, advantages, student = one.loss_mask[0], one.advantages[0], one.inference_logprobs[0]
            if not model.any():
                continue  # an all-masked padding row
            env_part = advantages[model] - 0.5 * (teacher[model] - student[model])
            assert torch.allclose(env_part, env_part[0].expand_as(env_part), atol=1e-4), env_part
            assert abs(float(env_part[0])) <= 0.5 + 1e-4 and (advantages[~model] == 0).all()
            gaps += (student[model] - teacher[model]).tolist()
    assert len(gaps) >= 8
    print(f"teacher_kl {[round(m['teacher_kl'], 5) for m in orch]}; recomputed {sum(gaps) / len(gaps):.5f}")
    assert orch[1]["teacher_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-4)
