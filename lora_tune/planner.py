"""`lora-tune plan`: will a fine-tune fit, and which setup that fits is fastest.

Everything is computed from config.json alone (shipped for aliases), never from weights:

* model states, per tensor, exactly as the libraries store them: bf16/fp16/fp32 weights; LLM.int8
  (int8 + one fp32 scale per output row); NF4 with double quantization (packed 4-bit, uint8 absmax
  per 64, fp32 absmax per 256 blocks, code books); LoRA weights, gradients in fp32; AdamW (two fp32
  states + step), bitsandbytes 8-bit AdamW (two uint8 states, fp32 absmax per 256, two 256-entry
  code books; tensors under 4096 elements stay 32-bit).
* parameters and LoRA parameters counted exactly on a meta-device skeleton of the config (any family
  transformers implements: fused projections, Conv1D, tied embeddings, MoE experts all stored).
* activations, per token and per layer, for HF's Llama-family layer with peft LoRA under autocast,
  derived by listing what autograd saves (and checked against saved_tensors_hooks in the tests);
  other families use the same terms with their shapes (plain 2-matrix MLPs: 2 e i; MoE: the
  active experts' MLPs per token):
    2 RMSNorms             2 x (4h + 4)        fp32 input + rsqrt, whatever the compute dtype
    SDPA                   e(2q + 2kv) + 4n    q, k, v (kv heads, not repeated), output; fp32 logsumexp
    SwiGLU MLP             3e i                gate output, SiLU output, up output
    each LoRA linear       e(d_in + r)         its input (recast for lora_A) and the rank-r middle;
                                               in fp32 (no recast) layers reading one input share it
    rotary cos/sin         2 e head_dim s      per layer and sequence
  where e is the compute dtype's size, q = heads*head_dim, kv = kv_heads*head_dim. Frozen base
  linears save nothing: their weight needs no gradient. With (non-reentrant) checkpointing each
  layer keeps only its input (e h per token) and one layer is recomputed at a time in backward.
* logits: with the chunked loss (the default), one chunk of C label tokens at a time: (8 + e) V C
  at the peak, plus the hidden-size gradient kept from forward (e h per token). With the full
  logits (--loss-chunk-size 0), the loss upcasts to fp32 and keeps it (4 V per token); backward adds
  the fp32 gradient and the compute-dtype logits exist meanwhile: (8 + e) V per token at the peak.
* packing fills every row up to --max-seq-len, so a micro-batch holds micro_batch_size x max_seq_len
  tokens: the same worst case the plan assumes without it (full-length samples).
* activation offload moves the checkpointed layer inputs (e h per token per layer) to host memory.
* ZeRO-2 divides gradients and optimizer states by the world size, ZeRO-3 also the weights (plus
  one gathered layer); offload moves optimizer states (ZeRO-3: also weights) to host RAM or NVMe.
  Bases under ZeRO-3 and FSDP2 are partitioned while they load (zero.Init, or layer by layer for
  quantized ones and FSDP2), so loading never holds more than a shard plus one layer.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lora_tune import engines
from lora_tune.adapter import Inventory, resolve_targets
from lora_tune.errors import UserError

GIB = 2**30
# Usable memory as drivers report it (a "16 GB" card shows ~15 GiB).
GPUS = {
    "t4": 15.0 * GIB, "l4": 22.5 * GIB, "a10g": 22.5 * GIB, "rtx4090": 23.6 * GIB, "rtx3090": 23.6 * GIB,
    "a100-40": 39.4 * GIB, "a100-80": 79.2 * GIB, "h100-80": 79.6 * GIB, "h200": 139.8 * GIB,
}
CUDA_CONTEXT = 512 * 2**20  # CUDA context + cuBLAS workspace: outside max_memory_allocated, but real
ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "8bit": 2, "4bit": 2}  # compute dtype size


@dataclass(frozen=True)
class Architecture:
    """The shapes of a causal LM, read off a meta-device skeleton of its config (no weights, no
    memory): every family transformers implements, counted exactly, whatever it fuses, ties,
    shares or spreads over experts."""

    model_type: str
    hidden: int
    intermediate: int  # MLP width (per expert for MoE)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated: bool  # SwiGLU/GeGLU MLP (gate, up, product) or a plain one (fc, activation)
    experts: int  # 0: dense
    active_experts: int  # experts per token (MoE)
    linears: tuple[tuple[str, int, int], ...]  # (short name, in, out) of every linear layer in the blocks
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # (path in a block, shape): fused expert tensors, routers
    inventory: Inventory
    total: int
    other_params: int  # not in a linear weight: embeddings, head, norms, biases, experts, routers

    @classmethod
    def from_config(cls, c: dict) -> "Architecture":
        return _architecture(json.dumps(c, sort_keys=True, default=str))

    def unquantized_params(self) -> int:
        """Everything bitsandbytes leaves in the compute dtype: it quantizes nn.Linear (and GPT-2's
        Conv1D) only, so embeddings, head, norms, biases, and fused 3-D MoE expert tensors stay."""
        return self.other_params

    def total_params(self) -> int:
        return self.total


@functools.lru_cache(maxsize=16)
def _architecture(config_json: str) -> Architecture:
    from transformers import AutoConfig

    from lora_tune.adapter import block_path, in_blocks, is_linear, meta_model

    c = json.loads(config_json)
    model_type = c.get("model_type")
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in c.items() if k != "model_type"})
        skeleton = meta_model(config)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--base: transformers can't build model_type {model_type!r} from this config.json ({str(e).splitlines()[0][:120]}); "
                        "only causal LMs that transformers implements (no remote code) can be planned") from None
    linears, linear_weights = [], set()
    for name, m in skeleton.named_modules():
        if is_linear(m) and in_blocks(name):
            # Conv1D (GPT-2) stores its weight (in, out)
            n_in, n_out = (m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else tuple(m.weight.shape)
            linears.append((name.rsplit(".", 1)[-1], int(n_in), int(n_out)))
            linear_weights.add(f"{name}.weight")
    params = dict(skeleton.named_parameters())
    tensors = tuple((block_path(n), tuple(p.shape)) for n, p in params.items() if in_blocks(n) and p.dim() >= 2 and n not in linear_weights)
    total = sum(p.numel() for p in params.values())
    names = {n for n, _, _ in linears}
    get = lambda *keys: next((getattr(config, k) for k in keys if getattr(config, k, None)), None)  # noqa: E731
    try:
        hidden, heads = config.hidden_size, config.num_attention_heads
    except AttributeError as e:  # e.g. Mamba: no attention, so no activation model here
        raise UserError(f"--base: {model_type} has no attention layers ({e}); the planner models transformer decoders only") from None
    return Architecture(
        model_type=model_type, hidden=hidden, intermediate=get("moe_intermediate_size", "intermediate_size", "n_inner") or 4 * hidden,
        layers=config.num_hidden_layers, heads=heads, kv_heads=get("num_key_value_heads") or heads, head_dim=get("head_dim") or hidden // heads,
        vocab=config.vocab_size, gated=bool(names & {"gate_proj", "gate_up_proj", "w1"}) or any("gate_up" in t for t, _ in tensors),
        experts=get("num_local_experts", "num_experts", "n_routed_experts") or 0, active_experts=get("num_experts_per_tok") or 1,
        linears=tuple(linears), tensors=tensors, inventory=Inventory.of(skeleton), total=total,
        other_params=total - sum(a * b for _, a, b in linears),
    )


def load_architecture(base: str) -> Architecture:
    from lora_tune.aliases import ALIASES, architecture, looks_like_path

    if base in ALIASES:
        return Architecture.from_config(architecture(base))
    if looks_like_path(base):
        path = Path(base).expanduser() / "config.json"
        if not path.is_file():
            raise UserError(f"--base: {path} does not exist; give a model folder with a config.json, or an alias from `lora-tune models`")
        return Architecture.from_config(json.loads(path.read_text()))
    from lora_tune.aliases import resolve_base

    resolved = resolve_base(base)  # unknown aliases fail here, with a suggestion
    try:
        from huggingface_hub import hf_hub_download

        return Architecture.from_config(json.loads(Path(hf_hub_download(resolved, "config.json")).read_text()))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise UserError(f"--base: could not read config.json of {resolved} ({str(e).splitlines()[0]}); pass an alias or a local folder") from None


@dataclass(frozen=True)
class Setup:
    precision: str = "bf16"
    rank: int = 16
    target_modules: tuple[str, ...] | None = None  # None: the default targets (every linear layer of the blocks, experts)
    micro_batch_size: int = 1
    max_seq_len: int = 2048
    gradient_checkpointing: bool = True
    optim: str = "adamw_8bit"
    loss_chunk_size: int | None = None  # None: lora_tune.loss.auto_chunk_size; 0: full logits
    activation_offload: bool = False
    backend: str = "single"
    zero: int = 0
    offload: str = "none"
    gpus: int = 1
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


@dataclass
class Estimate:
    trainable_parameters: int
    per_device: dict[str, int]
    host: dict[str, int]
    nvme_bytes: int
    saved_activations_bytes: int  # what autograd keeps between forward and backward


# --- model states ------------------------------------------------------------------------------------
def quantized_weight_bytes(n_in: int, n_out: int, precision: str) -> int:
    n = n_in * n_out
    if precision == "8bit":
        return n + 4 * n_out  # int8 weight + fp32 scale per output row (SCB)
    if precision == "4bit":
        blocks = math.ceil(n / 64)
        # packed NF4 + uint8 absmax per 64 + fp32 absmax per 256 blocks + NF4 code (16) + nested code (256) + offset
        return n // 2 + blocks + 4 * math.ceil(blocks / 256) + 16 * 4 + 256 * 4 + 4
    return n * {"fp32": 4, "bf16": 2, "fp16": 2}[precision]


def base_weight_bytes(arch: Architecture, precision: str) -> tuple[int, int]:
    """(all weights, one layer) in bytes as loaded."""
    dense = 4 if precision == "fp32" else 2
    linears = sum(quantized_weight_bytes(a, b, precision) for _, a, b in arch.linears)
    in_blocks = linears + dense * sum(math.prod(shape) for _, shape in arch.tensors)
    return linears + dense * arch.other_params, in_blocks // arch.layers


def lora_tensors(arch: Architecture, setup: Setup) -> list[int]:
    """Element counts of every LoRA tensor: A (r x in) and B (out x r) per targeted linear; for a
    fused expert tensor (E, out, in) peft's ParamWrapper stacks one rank-r pair per expert."""
    targets = resolve_targets(arch.inventory, setup)
    r = setup.rank
    sizes = []
    for name, n_in, n_out in arch.linears:
        if name in targets.modules:
            sizes += [r * n_in, n_out * r]
    for path, shape in arch.tensors:
        if path in targets.parameters:
            experts, (n_out, n_in) = (shape[0], shape[1:]) if len(shape) == 3 else (1, shape)
            sizes += [r * experts * n_in, n_out * r * experts]
    return sizes


def optimizer_bytes(tensors: list[int], optim: str) -> int:
    if optim == "adamw":
        return sum(8 * n + 4 for n in tensors)  # exp_avg + exp_avg_sq (fp32) + step
    total = 0
    for n in tensors:  # bitsandbytes 8-bit AdamW (paged: same bytes, may spill to host)
        total += 8 * n if n < 4096 else 2 * n + 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4
    return total


# --- activations ----------------------------------------------------------------------------------
def layer_activation_bytes_per_token(arch: Architecture, setup: Setup) -> float:
    e = ELEMENT[setup.precision]
    h, i = arch.hidden, arch.intermediate
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    norms = 2 * (4 * h + 4)
    attention = e * (2 * q + 2 * kv) + 4 * arch.heads
    mlp = (3 if arch.gated else 2) * e * i * (arch.active_experts if arch.experts else 1)  # MoE: each token's top-k experts
    targets = resolve_targets(arch.inventory, setup)
    per_layer = [(name, n_in) for name, n_in, _ in arch.linears[: len(arch.linears) // arch.layers] if name in targets.modules]
    lora = sum(e * setup.rank for _ in per_layer)  # lora_A outputs
    if setup.precision == "fp32":
        # No casts: LoRA layers reading the same input (q/k/v, gate/up) share one saved tensor.
        groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
        seen = set()
        for name, n_in in per_layer:
            group = next((g for g in groups if name in g), (name,))
            if group not in seen:
                seen.add(group)
                lora += e * n_in
    else:
        # Under autocast peft recasts the input of each LoRA layer: one copy per layer.
        lora += sum(e * n_in for _, n_in in per_layer)
    # Fused expert tensors: each token's input and rank-r middle, per active expert.
    experts = [shape for path, shape in arch.tensors if path in targets.parameters and len(shape) == 3]
    lora += sum(e * (shape[2] + setup.rank) * arch.active_experts for shape in experts) // arch.layers
    return norms + attention + mlp + lora


def activation_bytes(arch: Architecture, setup: Setup) -> tuple[int, int]:
    """(saved for backward, peak during backward) for one micro-batch, logits excluded."""
    e = ELEMENT[setup.precision]
    tokens = setup.micro_batch_size * setup.max_seq_len
    rope = 2 * e * arch.head_dim * setup.max_seq_len
    full_layer = int(layer_activation_bytes_per_token(arch, setup) * tokens) + rope
    final_norm = (4 * arch.hidden + 4) * tokens
    if not setup.gradient_checkpointing:
        saved = arch.layers * full_layer + final_norm
        return saved, saved
    # Each layer keeps its input (on the host with activation offload), one is rebuilt at a time.
    kept = 0 if setup.activation_offload else arch.layers * e * arch.hidden * tokens
    saved = kept + final_norm
    return saved, saved + full_layer


def logits_bytes(arch: Architecture, setup: Setup) -> tuple[int, int]:
    """(saved between forward and backward, peak). Full logits: the loss keeps the fp32 upcast (and
    labels); backward adds the fp32 gradient while the compute-dtype logits exist: (8 + e) V per
    token. Chunked (lora_tune.loss): one chunk of logits at a time in the compute dtype, fp32 and the
    fp32 softmax gradient, and the hidden-size gradient kept from forward to backward."""
    tokens = setup.micro_batch_size * setup.max_seq_len
    e = ELEMENT[setup.precision]
    if setup.loss_chunk_size != 0:
        from lora_tune.loss import auto_chunk_size

        chunk = min(setup.loss_chunk_size or auto_chunk_size(tokens, arch.hidden, arch.vocab), tokens)
        kept = tokens * arch.hidden * e + tokens * 8  # gradient w.r.t. the hidden states, labels
        return kept, kept + chunk * arch.vocab * (e + 8)
    return tokens * (4 * arch.vocab + 8), tokens * (8 + e) * arch.vocab


# --- the estimate ------------------------------------------------------------------------------
def estimate(arch: Architecture, setup: Setup) -> Estimate:
    n = setup.world
    weights, layer_weights = base_weight_bytes(arch, setup.precision)
    tensors = lora_tensors(arch, setup)
    trainable = sum(tensors)
    lora_bytes, grads, optim = 4 * trainable, 4 * trainable, optimizer_bytes(tensors, setup.optim)
    host = {"offloaded_optimizer_bytes": 0, "offloaded_weights_bytes": 0, "offloaded_activations_bytes": 0, "loading_bytes": 0}
    nvme = 0
    fsdp = setup.backend == "fsdp"
    if setup.zero >= 1 or fsdp:
        optim = math.ceil(optim / n)
    if setup.zero >= 2 or fsdp:
        grads = math.ceil(grads / n)
    # Parameters gathered at once: ZeRO-3 one layer; FSDP2 the layer in flight and the next one,
    # whose all-gather it prefetches.
    in_flight = 2 * layer_weights if fsdp else layer_weights
    if setup.zero == 3 or fsdp:
        weights = math.ceil(weights / n) + in_flight  # own shard + the gathered layer(s)
        lora_bytes = math.ceil(lora_bytes / n)
    if setup.offload != "none":
        moved_weights = 0
        if fsdp:
            # CPUOffloadPolicy: sharded weights, LoRA weights, gradients and optimizer states all
            # live on the host, and the optimizer steps there; the device keeps the layers in flight.
            offloaded = lora_bytes + grads + optim
            moved_weights = weights - in_flight
            weights, lora_bytes, grads, optim = in_flight, 0, 0, 0
        else:
            # DeepSpeed's CPU Adam: fp32 m, v and a fp32 master copy per shard (8-bit states can't go there).
            offloaded = math.ceil(12 * trainable / n)
            optim = 0
            if setup.zero == 3:
                moved_weights = weights - 2 * layer_weights
                weights = 2 * layer_weights  # working set: the gathered layer and the prefetched next
        if setup.offload == "cpu":
            host["offloaded_optimizer_bytes"] = offloaded * setup.gpus
            host["offloaded_weights_bytes"] = moved_weights * setup.gpus
        else:
            nvme = (offloaded + moved_weights) * setup.gpus
    # Loading: each process streams the checkpoint shard by shard (peak ~ one 5 GB shard) into
    # its device, or layer by layer (ZeRO-3 quantized, FSDP2), which is less.
    host["loading_bytes"] = setup.gpus * min(5 * 10**9, base_weight_bytes(arch, "bf16")[0])
    if setup.activation_offload and setup.gradient_checkpointing:
        host["offloaded_activations_bytes"] = setup.gpus * arch.layers * ELEMENT[setup.precision] * arch.hidden * setup.micro_batch_size * setup.max_seq_len
    host["total_bytes"] = sum(host.values())
    saved_act, peak_act = activation_bytes(arch, setup)
    saved_logits, peak_logits = logits_bytes(arch, setup)
    # LoRA weights recast to the compute dtype by autocast, plus allocator slack.
    overhead = CUDA_CONTEXT + ELEMENT[setup.precision] * trainable
    per_device = {
        "weights_bytes": weights, "trainable_bytes": lora_bytes, "gradients_bytes": grads, "optimizer_bytes": optim,
        "activations_bytes": peak_act, "logits_bytes": peak_logits, "overhead_bytes": overhead,
    }
    per_device["total_bytes"] = sum(per_device.values())
    return Estimate(trainable, per_device, host, nvme, saved_act + saved_logits)


# --- search ------------------------------------------------------------------------------------
# A deliberately simple throughput model (relative tokens/s per GPU): the cost of each choice as
# a multiplier on step time, from published comparisons (QLoRA paper, LLaMA-Factory and DeepSpeed
# docs). Good enough to rank setups; not a prediction of absolute speed.
SLOWDOWN = {
    "precision": {"bf16": 1.0, "fp16": 1.0, "fp32": 2.5, "8bit": 1.6, "4bit": 1.3},
    "checkpointing": {False: 1.0, True: 1.33},  # one extra forward
    "zero": {0: 1.0, 1: 1.02, 2: 1.05, 3: 1.2},
    "fsdp": 1.15,  # all-gathers per layer like ZeRO-3, overlapped by FSDP2's prefetch
    "offload": {"none": 1.0, "cpu": 1.6, "nvme": 3.0},
    "activation_offload": {False: 1.0, True: 1.1},  # a device-to-host copy per layer in forward, back in backward
}


def relative_speed(setup: Setup) -> float:
    tokens = setup.micro_batch_size * setup.max_seq_len
    utilisation = min(1.0, tokens / 8192) ** 0.3  # small batches leave the GPU underused
    cost = (SLOWDOWN["precision"][setup.precision] * SLOWDOWN["checkpointing"][setup.gradient_checkpointing]
            * (SLOWDOWN["fsdp"] if setup.backend == "fsdp" else SLOWDOWN["zero"][setup.zero]) * SLOWDOWN["offload"][setup.offload]
            * SLOWDOWN["activation_offload"][setup.activation_offload])
    return setup.world * utilisation / cost


def candidates(base: Setup, arch: Architecture):
    """Setups `train` runs (the backends' compatibility cells, and for this model), so the
    recommended command is exact."""
    cells = [c for c in engines.supported_cells()
             if c.precision in ("bf16", "8bit", "4bit") and engines.layer_by_layer_refusal(c, arch.model_type) is None]
    for cell in cells:
        if base.world > 1 and cell.backend == "single":
            continue  # one process can't use several GPUs
        if base.world == 1 and cell.backend != "single" and cell.offload == "none":
            continue  # sharding over one GPU only matters with offload
        for ckpt, act_offload in ((False, False), (True, False), (True, True)):
            for mbs in (1, 2, 4, 8, 16):
                yield replace(base, precision=cell.precision, backend=cell.backend, zero=cell.zero, offload=cell.offload,
                              gradient_checkpointing=ckpt, activation_offload=act_offload, micro_batch_size=mbs)


def fits(est: Estimate, gpu_bytes: int, cpu_bytes: int | None) -> bool:
    return est.per_device["total_bytes"] <= gpu_bytes and (cpu_bytes is None or est.host["total_bytes"] <= cpu_bytes)


def search(arch: Architecture, base: Setup, gpu_bytes: int, cpu_bytes: int | None):
    """(best fitting setup or None, its estimate, nearest setup when none fits)."""
    scored = [(s, estimate(arch, s)) for s in candidates(base, arch)]
    fitting = [(s, e) for s, e in scored if fits(e, gpu_bytes, cpu_bytes)]
    if fitting:
        best = max(fitting, key=lambda se: (relative_speed(se[0]), -se[1].per_device["total_bytes"]))
        return best[0], best[1], None
    nearest = min(scored, key=lambda se: se[1].per_device["total_bytes"])
    return None, None, nearest


def gpu_memory_bytes(text: str) -> int:
    from lora_tune.config import parse_size

    key = text.strip().lower()
    if key in GPUS:
        return int(GPUS[key])
    try:
        return parse_size(text, "--gpu-memory")
    except UserError:
        raise UserError(f"--gpu-memory: {text!r} is neither a size (e.g. 80GB) nor a known GPU ({', '.join(GPUS)})") from None


def gib(x: int) -> str:
    return f"{x / GIB:8.2f} GiB"


def table(est: Estimate, setup: Setup, gpu_bytes: int, cpu_bytes: int | None) -> str:
    rows = [f"setup: {setup.precision}, rank {setup.rank}, micro-batch {setup.micro_batch_size} x {setup.max_seq_len} tokens, "
            f"checkpointing {'on' if setup.gradient_checkpointing else 'off'}, {setup.optim}, {'FSDP2' if setup.backend == 'fsdp' else f'ZeRO-{setup.zero}'}, offload {setup.offload}, "
            f"{setup.gpus} GPU(s) x {setup.nodes} node(s)",
            f"trainable (LoRA) parameters: {est.trainable_parameters:,}", "per device:"]
    for k, v in est.per_device.items():
        rows.append(f"  {k.removesuffix('_bytes'):<13} {gib(v)}")
    rows.append("host:")
    for k, v in est.host.items():
        rows.append(f"  {k.removesuffix('_bytes'):<26} {gib(v)}")
    if est.nvme_bytes:
        rows.append(f"nvme: {gib(est.nvme_bytes)}")
    margin = gpu_bytes - est.per_device["total_bytes"]
    verdict = "fits" if margin >= 0 else "does NOT fit"
    rows.append(f"{verdict} in {gpu_bytes / GIB:.1f} GiB per GPU ({'spare' if margin >= 0 else 'short by'} {abs(margin) / GIB:.2f} GiB)")
    if cpu_bytes is not None and est.host["total_bytes"] > cpu_bytes:
        rows.append(f"host memory does NOT fit: needs {est.host['total_bytes'] / GIB:.1f} GiB of {cpu_bytes / GIB:.1f} GiB")
    return "\n".join(rows)


def train_command(base: str, setup: Setup) -> str:
    parts = ["lora-tune train", f"--base {base}", f"--precision {setup.precision}", f"--rank {setup.rank}",
             f"--micro-batch-size {setup.micro_batch_size}", f"--max-seq-len {setup.max_seq_len}", f"--optim {setup.optim}",
             "--gradient-checkpointing" if setup.gradient_checkpointing else "--no-gradient-checkpointing"]
    if setup.activation_offload:
        parts.append("--activation-offload")
    if setup.backend == "fsdp":
        parts += ["--backend fsdp", f"--offload {setup.offload}"]
    elif setup.zero:
        parts += [f"--zero {setup.zero}", f"--offload {setup.offload}"]
    if setup.nodes > 1:  # one torchrun per node; see the README's multi-node example
        launcher = f"torchrun --nnodes {setup.nodes} --nproc-per-node {setup.gpus} --node-rank RANK --master-addr HOST --master-port 29500 -m lora_tune train"
        return " ".join([launcher, *parts[1:]]) + " --data FILE --output-dir DIR"
    if setup.gpus > 1:
        parts.append(f"--nproc {setup.gpus}")
    return " ".join(parts) + " --data FILE --output-dir DIR"


OOM_ADVICE = [
    "a smaller --micro-batch-size with a larger --grad-accum (same effective batch)",
    "--gradient-checkpointing (recompute activations in backward), then --activation-offload (keep its layer inputs in host memory)",
    "the chunked loss: leave --loss-chunk-size at its default, or lower it (never the whole [tokens x vocab] logits)",
    "--optim adamw_8bit (2 B instead of 8 B of optimizer state per LoRA parameter)",
    "--precision 4bit (NF4 base: ~0.52 B per weight instead of 2)",
    "ZeRO-3 with CPU offload across several GPUs",
    "a shorter --max-seq-len",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)",
]


def setup_from(cfg) -> Setup:
    return Setup(precision=cfg.precision, rank=cfg.rank, target_modules=tuple(cfg.target_modules) if cfg.target_modules else None,
                 micro_batch_size=cfg.micro_batch_size, max_seq_len=cfg.max_seq_len, gradient_checkpointing=cfg.gradient_checkpointing,
                 optim="adamw" if cfg.optim == "adamw" else "adamw_8bit", loss_chunk_size=cfg.loss_chunk_size,
                 activation_offload=cfg.activation_offload,
                 backend=engines.backend_name(cfg), zero=getattr(cfg, "zero", 0), offload=getattr(cfg, "offload", "none"),
                 gpus=getattr(cfg, "gpus", None) or cfg.nproc or int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                 nodes=getattr(cfg, "nodes", None) or max(1, int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


@dataclass
class Plan:
    """What `lora-tune plan` computes: the numbers of `--json`, and the table it prints."""

    trainable_parameters: int
    per_device: dict[str, int]
    host: dict[str, int]
    nvme_bytes: int
    fits: bool
    setup: Setup
    auto: bool  # a search (--auto) rather than one setup
    recommended: dict | None  # --auto: the fastest setup that fits and its train command (None: nothing fits)
    text: str

    def to_json(self) -> dict:
        out = {"trainable_parameters": self.trainable_parameters, "per_device": self.per_device, "host": self.host,
               "nvme_bytes": self.nvme_bytes, "fits": self.fits}
        return {**out, "recommended": self.recommended} if self.auto else out


def unquantized_experts(precision: str, fused: int, total: int) -> str | None:
    """bitsandbytes quantizes linear layers only: how much of the model (`fused` of `total`
    parameters in 3-D expert tensors) stays in bf16 under 8/4-bit. Said by `train` and `plan`."""
    if precision in ("8bit", "4bit") and fused:
        count = lambda n: f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"  # noqa: E731
        return (f"{precision}: bitsandbytes quantizes linear layers only; this model's fused MoE expert tensors "
                f"({count(fused)} of {count(total)} parameters) stay in bf16")
    return None


def quantization_note(arch: Architecture, precision: str) -> str | None:
    fused = sum(math.prod(shape) for _, shape in arch.tensors if len(shape) == 3)
    note = unquantized_experts(precision, fused, arch.total_params())
    return f"note: {note}, and the figures above count them so" if note else None


def compute(cfg) -> Plan:
    from lora_tune.config import parse_size

    # Planning a cell `train` refuses would answer a question nobody can run: same matrix.
    engines.check_compatibility(cfg, paths=False)
    arch = load_architecture(cfg.base)
    if not cfg.auto:
        engines.check_layer_by_layer(cfg, arch.model_type)
    setup = setup_from(cfg)
    gpu_bytes = gpu_memory_bytes(cfg.gpu_memory)
    cpu_bytes = parse_size(cfg.cpu_memory, "--cpu-memory") if cfg.cpu_memory else None
    recommended = None
    if cfg.auto:
        best, est, nearest = search(arch, setup, gpu_bytes, cpu_bytes)
        if best is None:
            setup, est = nearest
            text = "nothing fits; the nearest option:\n" + table(est, setup, gpu_bytes, cpu_bytes)
        else:
            setup, command = best, train_command(cfg.base, best)
            recommended = asdict(best) | {"command": command}
            text = f"fastest setup that fits (relative speed {relative_speed(best):.2f}):\n{table(est, best, gpu_bytes, cpu_bytes)}\n\n{command}"
    else:
        est = estimate(arch, setup)
        text = table(est, setup, gpu_bytes, cpu_bytes)
    note = quantization_note(arch, setup.precision)
    text = f"{text}\n{note}" if note else text
    return Plan(est.trainable_parameters, dict(est.per_device), dict(est.host), est.nvme_bytes, fits(est, gpu_bytes, cpu_bytes),
                setup, bool(cfg.auto), recommended, text)


def run(cfg) -> int:
    """The `lora-tune plan` command; prints a table (or JSON) and returns the exit code."""
    result = compute(cfg)
    print(json.dumps(result.to_json()) if cfg.print_json else result.text)
    return 0
