"""On-policy distillation (`[orchestrator.teacher]`, docs/design.md §6): a teacher server scores the student's
own samples, and its per-token reverse-KL signal becomes the advantage.

Every rollout's prompt + completion goes to the teacher as one scoring request (`InferenceClient.score`), as
soon as its group is scored, while other groups still generate; at most `teacher.max_concurrency` requests per
teacher server are in flight, retried like every other request. On each token the student sampled (its
completion mask) the advantage is

    A_t = reward_weight · A_env + kl_coef · (log p_T(t) − log μ(t))

where μ is the student's sampling logprob (the one the trainer's importance ratio uses) and A_env the
rollout's group advantage from its reward; env-reply tokens of multi-turn rollouts get none. The term is the
negative of the per-token reverse-KL estimate log μ − log p_T, so the policy gradient lowers KL(μ ‖ p_T) on
the student's own samples. `teacher_kl` in metrics/orchestrator.jsonl is its mean over the step's model tokens.

Both sides of the gap are one distribution's: μ is log_softmax(logits / T) at the sampling temperature T,
renormalised over the token's kept set with top-p / top-k (sampling.py), so the teacher is scored the same way,
at T and over the same kept sets (the built-in engine's `prompt_logprobs_temperature` / `prompt_logprobs_kept`,
engine/scoring.py). A teacher that is the student then gives A_t = reward_weight · A_env exactly (measured
≤ 1e-6 at T = 0.7 and at top-p 0.8); scored at T = 1 over the whole vocabulary instead, the gap was up to 0.21
at T = 0.7 and −0.22 on every token at top-p 0.8, pulling the student toward logits = T × the teacher's. vLLM
scores prompts from raw logits only, so a vLLM teacher is refused at start (`Teacher.wait`, one line) unless
T = 1 without top-p / top-k.

Worked example, kl_coef 1, reward_weight 0.5, a rollout with A_env = 0.4 and two model tokens whose student
logprobs are [-1.0, -0.5] and teacher logprobs [-0.2, -2.5]: A = [0.2 + 0.8, 0.2 - 2.0] = [1.0, -1.8]; the
tokens' reverse KL is [-0.8, 2.0], so teacher_kl = 0.6.
"""

from __future__ import annotations

import asyncio
import logging
import statistics

from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig, TeacherConfig
from prime_rl.orchestrator.rollout import Group, Rollout
from prime_rl.orchestrator.servers.client import InferenceClient
from prime_rl.orchestrator.servers.pool import InferenceError

logger = logging.getLogger("prime_rl")


class TeacherMismatch(ValueError):
    """The teacher cannot score the student's tokens (another vocabulary, its tokenizer cannot be read, or its
    server cannot score at the sampling temperature and kept sets)."""


def token_advantages(rollout: Rollout, advantage: float, kl_coef: float, reward_weight: float) -> list[float]:
    """The per-token advantages of one scored rollout (`rollout.teacher_logprobs` set), 0 on env tokens."""
    teacher = rollout.teacher_logprobs
    if teacher is None or len(teacher) != len(rollout.completion_ids):
        raise ValueError("the rollout has no teacher logprob for each completion token")
    return [
        reward_weight * advantage + kl_coef * (t - s) if m else 0.0
        for t, s, m in zip(teacher, rollout.logprobs, rollout.completion_mask, strict=True)
    ]


def teacher_kl(rollouts: list[Rollout]) -> float | None:
    """Mean of log μ(t) − log p_T(t) over the model tokens of the scored rollouts; None when none was scored."""
    gaps = [
        s - t
        for r in rollouts
        if r.teacher_logprobs is not None
        for t, s, m in zip(r.teacher_logprobs, r.logprobs, r.completion_mask, strict=True)
        if m
    ]
    return statistics.fmean(gaps) if gaps else None


def check_vocabulary(student: str, teacher: str) -> None:
    """Refuse (TeacherMismatch, one line) a teacher whose tokenizer maps tokens to other ids than the student's."""
    from transformers import AutoTokenizer

    try:
        teacher_vocab = AutoTokenizer.from_pretrained(teacher).get_vocab()
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TeacherMismatch(f"cannot read teacher.model {teacher!r}'s tokenizer to check it: {first}") from None
    student_vocab = AutoTokenizer.from_pretrained(student).get_vocab()
    if teacher_vocab == student_vocab:
        return
    by_id = {i: t for t, i in student_vocab.items()}
    differ = sorted(i for t, i in teacher_vocab.items() if by_id.get(i) != t) or sorted(
        set(student_vocab.values()) - set(teacher_vocab.values())
    )
    first = differ[0]
    shown = next((t for t, i in teacher_vocab.items() if i == first), None)
    raise TeacherMismatch(
        f"teacher.model {teacher!r} has another vocabulary than model.name {student!r} ({len(teacher_vocab)} vs "
        f"{len(student_vocab)} tokens; id {first} is {shown!r} vs {by_id.get(first)!r}): the teacher would score "
        "other tokens than the student sampled"
    )


class Teacher:
    """The teacher servers and how their scores become advantages. Use as `async with Teacher(...) as teacher:`."""

    def __init__(self, config: TeacherConfig, client: ClientConfig, sampling: SamplingConfig, transport=None):
        self.config, self.temperature, self.filtered = config, sampling.temperature, sampling.filtered
        settings = client.model_dump() | {
            "base_url": config.base_url,
            "traffic_share": None,
            "api_key_var": config.api_key_var,
            "max_concurrency": config.max_concurrency,
        }
        self.client = InferenceClient(ClientConfig(**settings), config.model, transport=transport)

    async def __aenter__(self) -> Teacher:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def wait(self) -> None:
        """Until every teacher server answers /health (client.health_timeout) and, when the student samples at
        T ≠ 1 or with top-p / top-k, scores a probe at T over a kept set (else TeacherMismatch, one line)."""
        await self.client.wait_for_servers(self.client.config.health_timeout)
        if self.temperature != 1.0 or self.filtered:
            for server in self.client.pool.servers:
                try:  # token ids 0 and 1 exist in every vocabulary
                    await self.client.score([0, 1], server, self.temperature, {1: [0, 1]} if self.filtered else None)
                except InferenceError as e:
                    raise TeacherMismatch(
                        f"the student samples at temperature {self.temperature}"
                        f"{' with top-p / top-k' if self.filtered else ''}, so the teacher must be scored the same "
                        f"way, which teacher server {server.base} cannot: {e}"
                    ) from None
        logger.info(f"teacher {self.config.model} ready at {', '.join(self.config.base_url)}")

    async def distil(self, group: Group, advantages: list[float]) -> list[list[float]]:
        """Score the group's rollouts with the teacher (concurrently) and return their per-token advantages."""
        scores = await asyncio.gather(*(self._score(r) for r in group.rollouts))
        out = []
        for rollout, advantage, scored in zip(group.rollouts, advantages, scores, strict=True):
            rollout.teacher_logprobs = scored[len(rollout.prompt_ids) :]
            out.append(token_advantages(rollout, advantage, self.config.kl_coef, self.config.reward_weight))
        return out

    async def _score(self, rollout: Rollout) -> list[float]:
        """The teacher's logprob of each token of prompt + completion, at the sampling temperature and over each
        sampled token's kept set (position in the whole sequence -> ids; [] = nothing was filtered)."""
        start = len(rollout.prompt_ids)
        kept = {start + i: ids for i, ids in enumerate(rollout.kept or []) if ids}
        return await self.client.score(rollout.prompt_ids + rollout.completion_ids, None, self.temperature, kept)
