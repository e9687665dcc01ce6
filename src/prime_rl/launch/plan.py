"""`rl --plan`: what each process of a run needs in memory on a given cluster, and whether it fits, before anything
starts. Imports no torch: the model is its config.json (a local dir, the hub cache or the hub) or a known shape.

Trainer GPU (FSDP2, T trainer GPUs, each replica sharding over S = T / parallel.replicate of them; P parameters):
  fp32 master weights 4P/S, fp32 gradients 4P/S (LoRA: the adapter's only), AdamW's two fp32 moments 8P/S
  (LoRA: the adapter's); with cpu_offload these three live in host memory instead; the foreach AdamW step's
  temporaries, one more fp32 copy of what trains (4P/S);
  + the unsharded compute-dtype (bf16) copies in flight: the root unit (embeddings, head) and two decoder layers
    (one computing, one prefetched);
  + activations of one micro batch (orchestrator.seq_len tokens): with activation checkpointing each layer keeps
    its input (tokens x hidden, bf16) and one layer at a time its full set; without, every layer its full set
    (hidden-sized tensors x 6, the q/k/v/o widths, the MLP's three intermediate-sized ones);
  + CUDA context, NCCL and allocator slack (RUNTIME_GIB).
Inference GPU (vLLM, tensor parallel size tp): bf16 weights 2P/tp, RUNTIME_GIB, and the KV cache in what
gpu_memory_utilization leaves (K and V per token per layer: kv heads x head_dim, bf16, split over tp); it fits
when a whole max_model_len sequence fits.
Trainer node host memory: per rank, while loading its shards (~4P/S, trainer/loading.py), the asynchronous
checkpoint's staging copy of weights and moments (12P/S; LoRA: the adapter's), cpu_offload's 16P/S, and
HOST_PROCESS_GIB of process.
A floor, as estimates of memory are: allocator fragmentation and framework buffers come on top.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from prime_rl.configs.rl import RLConfig
from prime_rl.utils.hf_layout import checkpoint_file

GIB = 2**30
# CUDA context, NCCL buffers, the caching allocator's slack, per GPU process: nvidia-smi's peak minus torch's
# allocated peak of the trainer on an H200 was 4.6 and 5.1 GiB (docs/benchmarks.md, GPU acceptance).
RUNTIME_GIB = 5.0
HOST_PROCESS_GIB = 4.0  # torch, CUDA libraries and Python per trainer rank in host memory
VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM's own --gpu-memory-utilization default

# Shapes of models users train, as their hub config.json files give them (for a plan without the hub).
KNOWN: dict[str, dict] = {
    "Qwen/Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False),
    "Qwen/Qwen3-32B": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                           num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                           tie_word_embeddings=False),
    "meta-llama/Llama-3.3-70B-Instruct": dict(model_type="llama", hidden_size=8192, intermediate_size=28672,
                                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                              vocab_size=128256, tie_word_embeddings=False),
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                               moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
                               num_experts_per_tok=8, tie_word_embeddings=False),
}  # fmt: skip


@dataclass
class Shape:
    """What memory depends on in a decoder-only LM's config."""

    hidden: int
    intermediate: int  # the dense MLP's, or one expert's
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0  # 0: dense
    experts_per_token: int = 0
    qk_norm: bool = False

    @classmethod
    def of(cls, config: dict) -> Shape:
        kind = config.get("model_type", "")
        heads = config["num_attention_heads"]
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        return cls(
            hidden=config["hidden_size"],
            intermediate=config.get("moe_intermediate_size") if kind == "qwen3_moe" else config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            experts=experts,
            experts_per_token=config.get("num_experts_per_tok") or 0,
            qk_norm=kind in ("qwen3", "qwen3_moe"),
        )

    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (2 * q + 2 * kv) + (2 * self.head_dim if self.qk_norm else 0)
        mlp = 3 * self.hidden * self.intermediate * max(1, self.experts) + self.hidden * self.experts  # + router
        return attention + mlp + 2 * self.hidden  # + the two norms

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden  # embeddings, head, final norm

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def adapter_params(self, rank: int, targets: list[str]) -> int:
        """LoRA's A and B over `targets` in every layer: rank x (in + out) each (dense projections)."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                 "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
        return self.layers * sum(rank * sum(sizes[t]) for t in targets if t in sizes)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    def activation_bytes(self, tokens: int, checkpointed: bool) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        active = self.intermediate * max(1, self.experts_per_token)  # per token: each expert it is routed to
        full_layer = tokens * (6 * self.hidden + 2 * q + 2 * kv + 3 * active) * 2
        if checkpointed:
            return self.layers * tokens * self.hidden * 2 + full_layer
        return self.layers * full_layer


def model_config(name: str) -> dict:
    """`name`'s config.json: a local dir, the hub cache, a known shape, else the hub (one small file)."""
    path = Path(name) / "config.json" if Path(name).is_dir() else checkpoint_file(name, "config.json")
    if path is None and name in KNOWN:
        return KNOWN[name]
    if path is None:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(name, "config.json"))
    config = json.loads(path.read_text())
    return config.get("text_config", config) if "num_hidden_layers" not in config else config


@dataclass
class Line:
    process: str
    count: str
    need_gib: float
    have_gib: float
    detail: str

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.have_gib


def plan(config: RLConfig, shape: Shape) -> tuple[list[Line], list[str]]:
    """The plan's lines (one per kind of process or node) for `config`'s model of `shape`, and the knobs that would
    make what does not fit fit."""
    p = config.plan
    params, gpus = shape.params(), p.nodes * p.gpus_per_node
    inference_gpus = p.inference_gpus if p.inference_gpus is not None else (
        p.gpus_per_node // 2 if p.nodes == 1 else p.gpus_per_node)  # fmt: skip
    trainer_gpus = gpus - inference_gpus
    if not 0 < inference_gpus < gpus:
        raise ValueError(f"plan.inference_gpus = {inference_gpus} leaves no GPU for inference or for the trainer")
    trainer = config.trainer
    lora, offload, replicate = trainer.model.lora is not None, trainer.cpu_offload, trainer.parallel.replicate
    shard = trainer_gpus // replicate
    adapter = trainer.model.lora
    trained = params if not lora else shape.adapter_params(adapter.rank, list(adapter.target_modules))
    states = (4 * params + 12 * trained) / shard  # fp32 masters + gradients and moments of what trains
    step = 4 * trained / shard  # foreach AdamW's temporaries
    unsharded = 2 * (shape.root_params() + 2 * shape.layer_params())
    activations = shape.activation_bytes(config.orchestrator.seq_len, trainer.activation_checkpointing)
    on_gpu = (0 if offload else states + step) + unsharded + activations + RUNTIME_GIB * GIB
    lines = [Line("trainer GPU", f"{trainer_gpus} ({replicate} x {shard})" if replicate > 1 else str(trainer_gpus),
                  on_gpu / GIB, p.gpu_memory_gib,
                  f"{'offloaded ' if offload else ''}states {states / GIB:.1f} + step {step / GIB:.1f}, "
                  f"bf16 in flight {unsharded / GIB:.1f}, "
                  f"activations {activations / GIB:.1f}, runtime {RUNTIME_GIB:.0f}")]  # fmt: skip
    tp = config.inference.parallel.tp
    utilization = config.inference.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
    weights = 2 * params / tp
    kv = utilization * p.gpu_memory_gib * GIB - weights - RUNTIME_GIB * GIB
    kv_tokens = max(0, int(kv / (shape.kv_bytes_per_token() / tp)))
    need = (weights + RUNTIME_GIB * GIB + config.inference.max_model_len * shape.kv_bytes_per_token() / tp) / GIB
    lines.append(Line("inference GPU", f"{inference_gpus} ({inference_gpus // tp} x tp {tp})", need,
                      utilization * p.gpu_memory_gib,
                      f"bf16 weights {weights / GIB:.1f}, KV cache for {kv_tokens:,} tokens"))  # fmt: skip
    ranks_per_node = min(p.gpus_per_node, trainer_gpus)
    staging = 12 * trained / shard if trainer.ckpt is not None and trainer.ckpt.async_save else 0  # LoRA: its own
    host_rank = max(4 * params / shard, staging) + (16 * params / shard if offload else 0) + HOST_PROCESS_GIB * GIB
    if p.host_memory_gib is not None:
        detail = f"per rank {host_rank / GIB:.1f} (loading/staging, offload, process)"
        need = ranks_per_node * host_rank / GIB
        lines.append(Line("trainer node host", f"{ranks_per_node} ranks", need, p.host_memory_gib, detail))
    fixed = on_gpu - (0 if offload else states + step)
    return lines, knobs(lines, params, shard, fixed, p.gpu_memory_gib, trainer, tp)


def knobs(lines: list[Line], params: int, shard: int, fixed: float, gpu_gib: float, trainer, tp: int) -> list[str]:
    """What would make the lines that do not fit fit, most effective first."""
    out, lora = [], trainer.model.lora is not None
    if not lines[0].fits:
        room = gpu_gib * GIB - fixed
        need = math.ceil((4 if lora else 20) * params / room) if room > 0 else None
        if need is not None and need > shard:
            out.append(f"shard over >= {need} trainer GPUs (now {shard})")
        out += [] if lora else ["--trainer.model.lora.rank N (the base frozen: 4 bytes a parameter, not 20)"]
        out += [] if trainer.cpu_offload else ["--trainer.cpu-offload (states in host memory)"]
        out += [] if trainer.activation_checkpointing else ["--trainer.activation-checkpointing"]
        out.append("a smaller orchestrator.seq_len (activations)")
    if not lines[1].fits:
        need_tp = next((t for t in (2, 4, 8) if t > tp and lines[1].need_gib * tp / t <= lines[1].have_gib), None)
        out.append(f"--inference.parallel.tp {need_tp}" if need_tp else "bigger inference GPUs (no tp <= 8 fits)")
    if len(lines) > 2 and not lines[2].fits:
        out.append("more trainer nodes (fewer ranks' shards per node), or --trainer.ckpt.async-save false")
    return out


def render(config: RLConfig) -> tuple[str, bool]:
    """The plan as text, and whether everything fits."""
    shape = Shape.of(model_config(config.trainer.model.name))
    lines, fixes = plan(config, shape)
    p = config.plan
    head = (f"plan: {config.trainer.model.name} ({shape.params() / 1e9:.2f} B parameters"
            f"{f', {shape.experts} experts' if shape.experts else ''}) on {p.nodes} node(s) x {p.gpus_per_node} GPUs "
            f"of {p.gpu_memory_gib:g} GiB")  # fmt: skip
    rows = ["| process | count | needs GiB | has GiB | fits | what |", "|---|---|---|---|---|---|"]
    rows += [f"| {x.process} | {x.count} | {x.need_gib:.1f} | {x.have_gib:.1f} | {'yes' if x.fits else 'NO'} "
             f"| {x.detail} |" for x in lines]  # fmt: skip
    fits = all(x.fits for x in lines)
    tail = ["fits" if fits else "does not fit; try: " + "; ".join(fixes)]
    return "\n".join([head, *rows, *tail]), fits
