"""TRL's GRPOTrainer on our reverse-text task, set up like our `rl` run, to compare seconds per step.

    bash benchmarks/trl_env.sh                                        # once: .venv-trl (outside the lock)
    uv run tiny-model /tmp/trl-tiny --hidden-size 128 --num-layers 4 --tokenizer-vocab-size 259
    .venv-trl/bin/python benchmarks/trl_grpo.py --model /tmp/trl-tiny --steps 8 --json /tmp/trl.json

A driver in the project env runs it as a subprocess, `[".venv-trl/bin/python", "benchmarks/trl_grpo.py",
"--model", DIR, "--json", PATH, ...]`, and reads PATH (the last stdout line is the summary as JSON).

Mirrors benchmarks/loop.py handoffs' config on CPU, fp32, in TRL's sync mode (each step generates with the policy,
then trains on it once: num_iterations 1, `transformers.generate`, no vLLM):
- the same prompts in the same order and the same reward: our env module (prime_rl.envs.reverse_text) is
  imported from src/, its examples(seed) drawn in order (shuffle off) as our orchestrator's DataStream does;
  the chat template is applied as our server applies it (checked on the first prompt at start);
- a step = batch_size samples = batch_size / rollouts_per_example prompts × rollouts_per_example completions,
  one generation call, one optimizer step (gradient accumulation over `--micro-batch` samples);
- our defaults, read from prime_rl.configs so they cannot drift: AdamW betas / weight decay / grad-norm clip,
  constant lr without warmup, advantages = reward - group mean (no std scaling), token-mean loss, no KL.
Not the same by construction: TRL pads samples into [micro_batch, longest] tensors, ours packs them into
seq_len rows; TRL's loss is the PPO clip (ours: truncated importance ratio), identical on-policy (ratio 1).

Timing per optimizer step (wall clock): step = TrainerCallback on_step_begin → on_step_end; generate = TRL's
`_generate_and_score_completions` (generation, decoding and reward); train = step - generate (forward,
backward, optimizer). Medians over the steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # our env and config modules: pure Python (pydantic), no project install

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from prime_rl.configs.orchestrator import AdvantageConfig, OrchestratorConfig, SamplingConfig  # noqa: E402
from prime_rl.configs.trainer import LossConfig  # noqa: E402
from prime_rl.configs.training import OptimConfig  # noqa: E402
from prime_rl.envs import Example, load_environment  # noqa: E402


def default(config: type, key: str):
    return config.model_fields[key].default


def check_ours_are_plain() -> None:
    """The GRPOConfig below matches our defaults only while they are the plain ones; fail loudly if they move."""
    loss, adv, optim = LossConfig(), AdvantageConfig(), OptimConfig()
    plain = {
        "loss.kl_coef": (loss.kl_coef, 0.0),  # → beta 0 (TRL then builds no reference model)
        "loss.entropy_coef": (loss.entropy_coef, 0.0),
        "loss.norm": (loss.norm, "token"),  # → loss_type "dapo": mean over the step's loss tokens
        "advantage.baseline": (adv.baseline, "mean"),
        "advantage.std_norm": (adv.std_norm, False),  # → scale_rewards "none"
        "advantage.length_penalty": (adv.length_penalty, 0.0),
        "advantage.truncated": (adv.truncated, "keep"),  # → mask_truncated_completions False
        "advantage.skip_zero_advantage": (adv.skip_zero_advantage, False),
        "optim.type": (optim.type, "adamw"),
        "optim.scheduler": (optim.scheduler, "constant"),
        "optim.warmup_steps": (optim.warmup_steps, 0),
    }
    moved = {k: have for k, (have, want) in plain.items() if have != want}
    if moved:
        sys.exit(f"our defaults changed ({moved}); update the GRPOConfig mapping in {Path(__file__).name}")


def grpo_config(args: argparse.Namespace, total_steps: int) -> GRPOConfig:
    optim = OptimConfig()
    if args.batch_size % args.micro_batch or args.micro_batch % args.rollouts_per_example:
        sys.exit("--batch-size must be a multiple of --micro-batch, which must be a multiple of --rollouts-per-example")
    return GRPOConfig(
        output_dir=str(args.output_dir),
        use_cpu=True,
        bf16=False,  # TRL's default is bf16; ours is fp32 on CPU
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is True; ours: activation_checkpointing false
        seed=args.seed,
        max_steps=total_steps,
        # A step is the whole batch: TRL counts per_device_train_batch_size in samples (completions), and one
        # generation call covers per_device_train_batch_size × gradient_accumulation_steps of them.
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.batch_size // args.micro_batch,
        num_generations=args.rollouts_per_example,
        num_iterations=1,
        shuffle_dataset=False,  # our orchestrator takes the env's examples in order
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_p=default(SamplingConfig, "top_p"),
        top_k=0,  # off, as our samplers (TRL's default too)
        use_vllm=False,
        beta=0.0,
        scale_rewards="none",
        loss_type="dapo",
        mask_truncated_completions=False,
        learning_rate=args.lr,
        optim="adamw_torch_fused",  # ours: torch.optim.AdamW(fused=True)
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_epsilon=1e-8,  # torch's default, which ours keeps
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.max_norm,
        lr_scheduler_type="constant",
        warmup_steps=0,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


class StepTimer(TrainerCallback):
    """Wall clock of each optimizer step; `generate` is added by the wrapper around TRL's generation."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.generate = 0.0
        self.reward_mean: float | None = None
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.generate, self.reward_mean = 0.0, None
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step_s = time.perf_counter() - self._start
        self.rows.append({"step": state.global_step, "step_s": step_s, "generate_s": self.generate,
                          "train_s": step_s - self.generate, "reward_mean": self.reward_mean})  # fmt: skip


def check_prompt_tokens(tokenizer, prompt: list[dict]) -> None:
    """TRL renders chat prompts with apply_chat_template(tokenize=True); our server renders the text and
    tokenizes it without special tokens (inference/openai/serving.py chat_prompt_ids). Same ids, or stop."""
    ours = tokenizer(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids  # fmt: skip
    trl = tokenizer.apply_chat_template([prompt], tokenize=True, add_generation_prompt=True, return_dict=True)
    if list(trl["input_ids"][0]) != list(ours):
        sys.exit(f"prompt tokens differ from our server's:\n TRL  {trl['input_ids'][0]}\n ours {ours}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="local HF model dir (loaded fp32 on CPU)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=default(OrchestratorConfig, "batch_size"),
                        help="samples per step (our orchestrator.batch_size)")  # fmt: skip
    parser.add_argument("--rollouts-per-example", type=int, default=default(OrchestratorConfig, "rollouts_per_example"))
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="samples per forward/backward (TRL's per_device_train_batch_size, default 8)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32, help="sampling.max_tokens (loop.py handoffs: 32)")
    parser.add_argument("--temperature", type=float, default=default(SamplingConfig, "temperature"))
    parser.add_argument("--lr", type=float, default=1e-4, help="optim.lr (loop.py handoffs: 1e-4)")
    parser.add_argument("--env", default="reverse-text")
    parser.add_argument("--env-args", type=json.loads, default={}, help="JSON, our env.args")
    parser.add_argument("--env-seed", type=int, default=default(OrchestratorConfig, "seed"),
                        help="our orchestrator.seed: the examples drawn")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="torch / TRL seed (our trainer's seed default: 0)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads; unset = torch's default")
    parser.add_argument("--output-dir", type=Path, default=Path("/tmp/trl-grpo-out"), help="TRL's (nothing saved)")
    parser.add_argument("--json", type=Path, help="write the per-step rows and the summary here")
    args = parser.parse_args()

    check_ours_are_plain()
    if args.threads:
        torch.set_num_threads(args.threads)
    total = args.steps + args.warmup
    prompts_per_step = args.batch_size // args.rollouts_per_example

    env = load_environment(args.env, **args.env_args)
    stream = env.examples(args.env_seed)
    examples: list[Example] = [next(stream) for _ in range(total * prompts_per_step)]
    if not all(isinstance(e.prompt, list) for e in examples):
        sys.exit("this benchmark handles chat-message prompts only")
    # The Example rides along as JSON so the reward calls our env's own score() on it.
    dataset = Dataset.from_dict({"prompt": [e.prompt for e in examples],
                                 "example": [json.dumps(e.__dict__) for e in examples]})  # fmt: skip

    timer = StepTimer()

    def reward(completions, example, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [float(env.score(t, Example(**json.loads(e)))) for t, e in zip(texts, example, strict=True)]
        timer.reward_mean = statistics.fmean(scores)
        return scores

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    check_prompt_tokens(tokenizer, examples[0].prompt)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=grpo_config(args, total), train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])  # fmt: skip

    generate_and_score = trainer._generate_and_score_completions

    def timed(*a, **kw):
        start = time.perf_counter()
        try:
            return generate_and_score(*a, **kw)
        finally:
            timer.generate += time.perf_counter() - start

    trainer._generate_and_score_completions = timed
    start = time.perf_counter()
    trainer.train()
    run_s = time.perf_counter() - start

    rows = timer.rows[args.warmup :]
    if len(timer.rows) != total or not rows:
        sys.exit(f"ran {len(timer.rows)} steps, expected {total}")
    summary = {
        "trl": __import__("trl").__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": str(args.model),
        "steps_measured": len(rows),
        **{k: statistics.median(r[k] for r in rows) for k in ("step_s", "generate_s", "train_s")},
        "reward_mean_last": timer.rows[-1]["reward_mean"],
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
        "run_s": run_s,
    }
    print(f"TRL {summary['trl']} GRPO, {args.model.name}, {summary['threads']} threads: step "
          f"{summary['step_s']:.3f} s = generate {summary['generate_s']:.3f} s + train {summary['train_s']:.3f} s "
          f"(medians of {len(rows)} steps), peak RSS {summary['peak_rss_gib']:.2f} GiB", file=sys.stderr)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": timer.rows, "warmup": args.warmup}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
