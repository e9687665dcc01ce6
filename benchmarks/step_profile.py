"""Where the time goes: one trainer step and one decode of a batch, ours beside plain `transformers` on the same
tokens, each with torch profiler's top ops and Python frames.

    uv run python benchmarks/step_profile.py                           # the 0.8 M model: ~30 s on 2 cores
    uv run python benchmarks/step_profile.py --size real --layers 2    # Qwen3-0.6B's layer shapes, 2 of them: ~1.5 min
    uv run python benchmarks/step_profile.py --size real --apart       # all 28 (0.44 B): ~22 min, ~14 GiB

The models: `tiny` = hidden 128, 4 layers, a 259-id byte vocabulary (0.8 M parameters: the TRL comparison's,
benchmarks/trl_grpo.py); `real` = `tiny-model --preset qwen3-0.6b --vocab-size 2048` as benchmarks/real_size.py
builds it (0.44 B at 28 layers), loaded in fp32. The tokens: a GRPO batch of 8 prompts x 8 completions, prompts of
24-40 random ids, completions of exactly `--completion` ids, loss on the completions, AdamW, fp32, one rank.
- train, ours: `prime_rl.trainer` as the RL trainer runs a step (samples packed into rows of `--seq-len`, the RL
  loss, fused AdamW, grad clip), on the packed micro batches the orchestrator would write;
- train, transformers: the step TRL's GRPOTrainer takes on them: left-padded micro batches of `--micro-batch`
  samples, forward with `logits_to_keep` = the completion, log-softmax at the completion's ids and the entropy
  (TRL logs it), the token-mean policy-gradient loss (on-policy: ratio 1), backward, clip, fused AdamW;
- decode, ours: the built-in engine (its worker thread, in a process set up as the server's) given the 8 prompts
  x n=8 at once, `--completion` tokens each (ignore_eos), temperature 1;
- decode, transformers: `model.generate` on the same 64 prompts, left-padded, KV cache, sampling, exactly
  `--completion` new tokens.
Each is warmed up once, then timed `--reps` times, the two sides taking turns (with `--apart`, one side after the
other, each freed before the next is built; the decode's sides always one after the other, each in a process of
its own); one more run of each under torch.profiler gives its top ops and Python frames by self CPU time. The
table shows medians and ours / theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import queue
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import add_json_argument, markdown_table, write_json

PROMPTS, ROLLOUTS = 8, 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("tiny", "real"), default="tiny")
    p.add_argument("--layers", type=int, default=28, help="--size real: decoder layers of the 0.6B shape")
    p.add_argument("--completion", type=int, default=32, help="tokens per completion")
    p.add_argument("--seq-len", type=int, default=2048, help="ours: tokens per packed row")
    p.add_argument("--micro-batch", type=int, default=8, help="transformers: samples per micro batch (TRL's)")
    p.add_argument("--reps", type=int, default=5, help="timed runs per side (median reported)")
    p.add_argument("--top", type=int, default=10, help="ops / frames listed per profile")
    p.add_argument("--only", choices=("train", "decode"), help="one of the two comparisons")
    p.add_argument("--no-share-prompts", action="store_true", help="ours: every completion computes its prompt again")
    p.add_argument("--default-malloc", action="store_true", help="glibc's default malloc, not the trainer's tuning")
    p.add_argument("--apart", action="store_true", help="one side in memory at a time (28 layers: 24 GiB hold one)")
    add_json_argument(p, "step_profile")
    return p.parse_args()


def build_model(args, root: Path) -> Path:
    from prime_rl.utils.tiny_model import create_tiny_model

    if args.size == "tiny":
        return create_tiny_model(root / "tiny", hidden_size=128, num_layers=4, tokenizer_vocab_size=259)
    return create_tiny_model(root / "real", preset="qwen3-0.6b", num_layers=args.layers, vocab_size=2048)


def batch_tokens(args, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts, and each of the 64 samples' completion (8 per prompt), as token ids (seeded)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(24, 41, (PROMPTS,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    completions = [torch.randint(3, vocab, (args.completion,), generator=g).tolist() for _ in prompts * ROLLOUTS]
    return prompts, completions


def advantages_of(n: int) -> list[float]:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(n, generator=g).view(PROMPTS, ROLLOUTS)
    return (a - a.mean(dim=1, keepdim=True)).flatten().tolist()  # group-relative, as both sides compute it


def fp32(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


# ---- train -----------------------------------------------------------------------------------------------


def ours_train(path: Path, args, prompts, completions) -> Callable[[], None]:
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.protocol.packing import pack_rows
    from prime_rl.protocol.records import Sample
    from prime_rl.trainer.loading import build_training
    from prime_rl.trainer.micro_batch import MicroBatch
    from prime_rl.trainer.parallel import init_distributed
    from prime_rl.trainer.rl.train import rl_loss, train_step

    config = TrainerConfig(model={"name": str(path)}, device="cpu", optim={"lr": 1e-5},
                           share_prompts=not args.no_share_prompts)  # fmt: skip
    dist = init_distributed("cpu")
    model, optimizer, _ = build_training(config, dist, max_steps=1)
    samples = []
    for i, (completion, advantage) in enumerate(zip(completions, advantages_of(len(completions)), strict=True)):
        prompt = prompts[i // ROLLOUTS]
        mask = [False] * len(prompt) + [True] * len(completion)
        samples.append(Sample(prompt + completion, mask, [advantage] * len(mask), [-7.0] * len(mask)))
    rows = [MicroBatch.from_row(row) for row in pack_rows(samples, args.seq_len, temperature=1.0)]
    loss = rl_loss(config.loss)
    return lambda: train_step(model, optimizer, rows, config, dist, loss)


def transformers_train(path: Path, args, prompts, completions) -> Callable[[], None]:
    model = fp32(path).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    advantages = torch.tensor(advantages_of(len(completions)))
    batches = []
    for start in range(0, len(completions), args.micro_batch):
        rows = range(start, start + args.micro_batch)
        longest = max(len(prompts[i // ROLLOUTS]) for i in rows)
        ids = torch.zeros(len(rows), longest + args.completion, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for j, i in enumerate(rows):
            prompt = prompts[i // ROLLOUTS]
            ids[j, longest - len(prompt) :] = torch.tensor(prompt + completions[i])  # left-padded, as TRL's
            attention[j, longest - len(prompt) :] = 1
        batches.append((ids, attention, advantages[start : start + args.micro_batch]))
    c, total = args.completion, len(completions) * args.completion

    def step() -> None:
        for ids, attention, adv in batches:
            logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=c + 1).logits[:, :-1]
            logp = logits.log_softmax(-1)
            token_logp = logp.gather(-1, ids[:, -c:, None]).squeeze(-1)
            with torch.no_grad():
                (-(logp.exp() * logp).sum(-1)).mean()  # the entropy TRL reports
            ratio = torch.exp(token_logp - token_logp.detach())
            (-(ratio * adv[:, None]).sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# ---- decode ----------------------------------------------------------------------------------------------


def ours_decode(path: Path, args, prompts, _) -> Callable[[], None]:
    from prime_rl.inference.engine.build import build_engine
    from prime_rl.inference.engine.sampling import SamplingParams

    engine = build_engine(str(path), device="cpu", max_batch_size=len(prompts) * ROLLOUTS)
    params = SamplingParams(n=ROLLOUTS, max_tokens=args.completion, ignore_eos=True)
    loop = asyncio.new_event_loop()

    async def all_prompts():
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    def run() -> None:
        loop.run_until_complete(all_prompts())

    run.close = engine.close
    return run


def transformers_decode(path: Path, args, prompts, _) -> Callable[[], None]:
    model = fp32(path).eval()
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts) * ROLLOUTS, longest, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for j in range(ids.shape[0]):
        prompt = prompts[j // ROLLOUTS]
        ids[j, longest - len(prompt) :], attention[j, longest - len(prompt) :] = torch.tensor(prompt), 1
    n = args.completion
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    def run() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=attention, **kwargs)

    return run


COMPARISONS = {"train": (ours_train, transformers_train), "decode": (ours_decode, transformers_decode)}
SIDES = ["ours", "transformers"]


BUILTIN = re.compile(r"<built-in (?:method|function) (\w+)(?: of [^>]*)?>")  # shown as `name (built-in)`
# Frames of threads that wait (the engine's worker between requests, the event loop, a heartbeat): not work.
IDLE = ("threading.py(", "method poll of select", "method acquire of _thread.lock", "method select of")


def profiled(fn: Callable[[], None], top: int) -> list[dict]:
    """The top ops and Python frames (`file(line): name`) of one run of `fn` by self CPU time, waits left out;
    share = of the run's profiled self CPU time without them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
    busy = (e for e in prof.key_averages() if not any(idle in e.key for idle in IDLE))
    events = sorted(busy, key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [
        {"name": BUILTIN.sub(r"\1 (built-in)", e.key)[:90], "self_ms": e.self_cpu_time_total / 1e3,
         "share": e.self_cpu_time_total / total, "calls": e.count}
        for e in events[:top]
    ]  # fmt: skip


def timed(sides: dict[str, Callable[[], None]], args) -> dict:
    """Warm each side up, time `--reps` runs taking turns (a slow spell slows both), then profile one run each."""
    for fn in sides.values():
        fn()
    times = {side: [] for side in sides}
    for rep in range(args.reps):
        for side in sorted(sides, reverse=rep % 2 == 1):
            start = time.perf_counter()
            sides[side]()
            times[side].append(time.perf_counter() - start)
    result = {}
    for side, fn in sides.items():
        result[side] = {
            "times": times[side],
            "median": statistics.median(times[side]),
            "profile": profiled(fn, args.top),
        }
        getattr(fn, "close", lambda: None)()  # the engine's worker
    return result


def compare(name: str, path: Path, args, tokens) -> dict:
    """Both sides of one comparison, built in this process and timed taking turns; with `--apart` each side is
    built, timed, profiled and freed before the other is built. The decode's sides run in processes of their own."""
    if name == "decode":
        return {side: in_own_process(side, path, args, tokens) for side in SIDES}
    builders = dict(zip(SIDES, COMPARISONS[name], strict=True))
    result = {}
    for group in [[side] for side in SIDES] if args.apart else [SIDES]:
        result |= timed({side: builders[side](path, args, *tokens) for side in group}, args)
        gc.collect()
    return result


def decode_side(side: str, path: Path, args, tokens, results: multiprocessing.Queue) -> None:
    """A spawned process's work: one decode side, timed and profiled."""
    build = COMPARISONS["decode"][SIDES.index(side)]
    results.put(timed({side: build(path, args, *tokens)}, args)[side])


def in_own_process(side: str, path: Path, args, tokens) -> dict:
    """One decode side in a process of its own, ours with OMP_NUM_THREADS=1 as the server runs it (only the
    engine's worker computes on several threads, prime_rl.inference.server). In one process the engine's worker
    and the thread running `generate` would each keep an OpenMP pool, and libgomp, managing more threads than
    cores, stops spinning between parallel regions: small ops of both sides ran ~2x slower."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=decode_side, args=(side, path, args, tokens, results))
    saved = os.environ.get("OMP_NUM_THREADS")
    if side == "ours":
        os.environ["OMP_NUM_THREADS"] = "1"  # read by the child's libgomp when it imports torch
    try:
        process.start()
    finally:
        os.environ.pop("OMP_NUM_THREADS", None) if saved is None else os.environ.update(OMP_NUM_THREADS=saved)
    while True:
        try:
            result = results.get(timeout=1)
            break
        except queue.Empty:
            if not process.is_alive():
                raise SystemExit(f"the {side} decode process exited with {process.exitcode}") from None
    process.join(timeout=60)
    return result


def report(name: str, result: dict, args) -> str:
    ours, theirs = result["ours"]["median"], result["transformers"]["median"]
    line = f"{name}: ours {ours:.3f} s, transformers {theirs:.3f} s, ours / theirs {ours / theirs:.2f}x"
    if name == "decode":
        line += f" ({ours / args.completion * 1e3:.1f} / {theirs / args.completion * 1e3:.1f} ms a token)"
    lines = [line]
    for side in ("ours", "transformers"):
        top = enumerate(result[side]["profile"], 1)
        rows = [(i, f"`{e['name']}`", f"{e['self_ms']:.1f}", f"{e['share']:.0%}", e["calls"]) for i, e in top]
        lines += [f"\n{name}, {side}: top {args.top} by self CPU time (waits left out)"]
        lines += [markdown_table(["#", "op / frame", "ms", "share", "calls"], rows)]
    return "\n".join(lines)


def main() -> None:
    from transformers import AutoConfig

    args = parse_args()
    if not args.default_malloc:
        from prime_rl.utils.host_memory import keep_freed_memory

        keep_freed_memory()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args, Path(tmp))
        tokens = batch_tokens(args, AutoConfig.from_pretrained(path).vocab_size)
        results = {}
        for name in [args.only] if args.only else COMPARISONS:
            results[name] = compare(name, path, args, tokens)
            print(report(name, results[name], args), flush=True)
    rows = []
    for name, r in results.items():
        ours, theirs = r["ours"]["median"], r["transformers"]["median"]
        rows.append((name, f"{ours:.3f} s", f"{theirs:.3f} s", f"{ours / theirs:.2f}x"))
    print(f"\n{args.size} model, {PROMPTS} prompts x {ROLLOUTS} completions of {args.completion} tokens, median of "
          f"{args.reps}:\n" + markdown_table(["", "ours", "transformers", "ours / theirs"], rows))  # fmt: skip
    write_json(args, "step_profile", {"results": results})


if __name__ == "__main__":
    main()
