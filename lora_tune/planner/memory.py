"""The memory model: bytes per device and per host for one setup, from the architecture alone.

* Model states, per tensor, exactly as the libraries store them: bf16/fp16/fp32 weights; LLM.int8
  (int8 + one fp32 scale per output row); NF4 with double quantization (packed 4-bit, uint8 absmax
  per 64, fp32 absmax per 256 blocks, code books); LoRA weights, gradients in fp32; AdamW (two fp32
  states + step), bitsandbytes 8-bit AdamW (two uint8 states, fp32 absmax per 256, two 256-entry
  code books; tensors under 4096 elements stay 32-bit). How they are split over ranks and what CPU
  offload moves to the host is each backend's own declaration (`BackendSpec.place`).
* Activations, per token and per layer, for HF's Llama-family layer with peft LoRA under autocast,
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
* Logits: with the chunked loss (the default), one chunk of C label tokens at a time: (8 + e) V C
  at the peak, plus the hidden-size gradient kept from forward (e h per token). With the full
  logits (--loss-chunk-size 0), the loss upcasts to fp32 and keeps it (4 V per token); backward adds
  the fp32 gradient and the compute-dtype logits exist meanwhile: (8 + e) V per token at the peak.
* Packing fills every row up to --max-seq-len, so a micro-batch holds micro_batch_size x max_seq_len
  tokens: the same worst case the plan assumes without it (full-length samples). On a CPU a
  micro-batch runs in passes of whole rows (lora_tune.data.batching.passes): activations and logits
  are a pass's, as many full rows as its token budget holds (one at least).
* Activation offload moves the checkpointed layer inputs (e h per token per layer) to host memory.
* Online RL (GRPO): a micro-batch trains prompt + completion (max_seq_len + max_new_tokens tokens per
  sequence); before it, the policy generates a step's completions at once with a KV cache of
  2 e kv per token per layer for prompt + max_new_tokens tokens, and each decoding step holds the
  [sequences x vocab] scores (compute dtype, and three fp32 copies while sampling). With tools the
  completion (every turn, tool results included) stays within --max-new-tokens, and a later turn's
  rows decode up to --max-new-tokens more after it: the cache counts that longest episode. Generation and
  training never hold their working sets at the same time: the plan counts the larger, and shows
  generation's excess over training's activations as `generation`. With --rollout vllm colocated,
  vLLM's copy of the base and its KV cache take that place (on a GPU vLLM reserves
  --vllm-gpu-memory-utilization of it, said); a vLLM server's memory is the server's, not here.
* Image-text models: the vision tower's weights (`vision_tower`), and a micro-batch's images (pixel
  values, the tower's forward) in `images`: lora_tune.planner.vision.
* Loading: bases under ZeRO-3 and FSDP2 are partitioned while they load (zero.Init, or layer by
  layer), so loading never holds more than a shard plus a layer; otherwise each process streams the
  checkpoint shard by shard.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from lora_tune.engines import registry as engines
from lora_tune.engines.spec import ModelStates
from lora_tune.models.adapter import trained_sizes, uniform_lora
from lora_tune.models.adapter_types import registry as adapter_types
from lora_tune.models.head import auto_chunk_size
from lora_tune.models.targets import lora_targets, resolve_targets
from lora_tune.planner import vision
from lora_tune.planner.architecture import Architecture
from lora_tune.planner.records import Setup
from lora_tune.training.generation import registry as generation
from lora_tune.training.objectives import registry as objectives

GIB = 2**30
CUDA_CONTEXT = 512 * 2**20  # CUDA context + cuBLAS workspace: outside max_memory_allocated, but real
ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "8bit": 2, "4bit": 2}  # compute dtype size
SHARD_BYTES = 5 * 10**9  # the usual largest checkpoint shard: what a whole-model load streams at a time


@dataclass(frozen=True)
class Estimate:
    trainable_parameters: int
    per_device: dict[str, int]
    host: dict[str, int]
    saved_activations_bytes: int  # what autograd keeps between forward and backward


def setup_from(cfg, attention: str | None = None) -> Setup:
    """The setup a training (or plan) configuration describes; world size from the plan's --gpus /
    --nodes, else --nproc, else the launcher's environment. `attention`: the implementation the run
    resolved; else --attn-implementation, auto planned as flash-attention (a GPU's, when installed)."""
    if attention is None:
        chosen = "flash_attention_2" if cfg.attn_implementation == "auto" else cfg.attn_implementation
        attention = f"ulysses_{chosen}" if cfg.sequence_parallel > 1 else chosen
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    objective = objectives.of(cfg)
    return Setup(
        precision=cfg.precision,
        rank=cfg.rank,
        target_modules=tuple(cfg.target_modules) if cfg.target_modules else None,
        micro_batch_size=cfg.micro_batch_size,
        max_seq_len=cfg.max_seq_len,
        gradient_checkpointing=cfg.gradient_checkpointing != "off",  # auto: every layer, until a budget decides (search.py)
        optim="adamw" if cfg.optim == "adamw" else "adamw_8bit",
        loss_chunk_size=cfg.loss_chunk_size,
        activation_offload=cfg.activation_offload,
        backend=engines.backend_name(cfg),
        zero=cfg.zero,
        offload=cfg.offload,
        gpus=getattr(cfg, "gpus", None) or cfg.nproc or local,
        nodes=getattr(cfg, "nodes", None) or max(1, int(os.environ.get("WORLD_SIZE", 1)) // local),
        objective=objective.name,
        sequences_per_unit=objective.sequences_per_unit,
        sequence_parallel=cfg.sequence_parallel,
        attention=attention,
        reference=objective.reference,
        new_tokens=cfg.max_new_tokens if objective.online else 0,
        rollout_sequences=cfg.micro_batch_size * cfg.grad_accum if objective.online else 0,
        rollout=generation.name(cfg),
        turn_tokens=turn_tokens(cfg, objective.online),
        max_pixels=cfg.max_pixels,
        train_vision=cfg.train_vision,
    )


def turn_tokens(cfg, online: bool) -> int:
    """With tools, the longest episode a decoding pass holds: a later turn's rows are the prompt and
    the completion so far (up to --max-new-tokens, tool results of at most --max-tool-result-tokens
    included), left-padded to the longest, and each decodes up to --max-new-tokens more before it is
    cut to what its budget leaves. A colocated vLLM pages each sequence alone: no padding to count."""
    agentic = getattr(cfg, "tools", None) or getattr(cfg, "environment", None)
    return cfg.max_new_tokens if online and agentic and generation.name(cfg) != "vllm-colocate" else 0


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


def vision_weight_bytes(arch: Architecture, precision: str) -> int:
    """The vision tower and projector as loaded: bitsandbytes quantizes their linear layers too."""
    tower = arch.vision
    if tower is None:
        return 0
    quantized = tower.quantized if precision in ("8bit", "4bit") else ()
    dense = (4 if precision == "fp32" else 2) * (tower.params - sum(a * b for a, b in quantized))
    return dense + sum(quantized_weight_bytes(a, b, precision) for a, b in quantized)


def lora_tensors(arch: Architecture, setup: Setup) -> list[int]:
    """Element counts of every LoRA tensor: A (r x in) and B (out x r) per targeted linear; for a
    fused expert tensor (E, out, in) peft's ParamWrapper stacks one rank-r pair per expert."""
    if setup.adapter_sizes is not None:
        return list(setup.adapter_sizes)
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
    return sizes + vision.lora_tensors(arch.vision, setup, set(targets.modules))


def optimizer_bytes(tensors: list[int], optim: str) -> int:
    if optim == "adamw":
        return sum(8 * n + 4 for n in tensors)  # exp_avg + exp_avg_sq (fp32) + step
    total = 0
    for n in tensors:  # bitsandbytes 8-bit AdamW (paged: same bytes, may spill to host)
        total += 8 * n if n < 4096 else 2 * n + 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4
    return total


def with_adapter(cfg, arch: Architecture, setup: Setup, targets=None) -> Setup:
    """The setup with its adapter's tensors counted by peft itself, when it is not a uniform LoRA
    (`targets`: the run's, resolved before loading; else resolved here on the meta skeleton)."""
    if uniform_lora(cfg) or arch.config is None:
        return setup
    extra = adapter_types.state_bytes(cfg)
    terms = adapter_types.planned(cfg)
    if terms:  # peft can't build it on the meta skeleton: the type's own per-linear terms
        modules = resolve_targets(arch.inventory, setup).modules
        adapted = [terms(n_in, n_out, cfg) for name, n_in, n_out in arch.linears if name in modules]
        sizes, fixed = tuple(n for trained, _ in adapted for n in trained), sum(f for _, f in adapted)
        return replace(setup, adapter_sizes=sizes, adapter_state_bytes=extra, adapter_fixed_bytes=fixed)
    targets = targets or lora_targets(cfg, arch.config)
    sizes = trained_sizes(arch.config, cfg, targets) if targets is not None else None
    return replace(setup, adapter_sizes=sizes, adapter_state_bytes=extra) if sizes is not None else setup


def model_states(arch: Architecture, setup: Setup) -> ModelStates:
    """What one process would hold with nothing sharded."""
    weights, layer_weights = base_weight_bytes(arch, setup.precision)
    tensors = lora_tensors(arch, setup)
    trainable = sum(tensors)
    return ModelStates(
        weights=weights,
        layer_weights=layer_weights,
        trainable=4 * trainable,
        gradients=4 * trainable,
        optimizer=optimizer_bytes(tensors, setup.optim) + setup.adapter_state_bytes * trainable,
        trainable_params=trainable,
    )


# --- activations ----------------------------------------------------------------------------------
MLP_LINEARS = {
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "fc1",
    "fc2",
    "w1",
    "w2",
    "w3",
    "c_fc",
    "dense_h_to_4h",
    "dense_4h_to_h",
}


def layer_terms_per_token(arch: Architecture, setup: Setup) -> tuple[float, float]:
    """(everything but the MLP, the MLP with its LoRA layers): bytes a decoder layer saves per token."""
    e = ELEMENT[setup.precision]
    h, i = arch.hidden, arch.intermediate
    kv_heads = arch.kv_heads if arch.kv_heads % setup.sequence_parallel == 0 else arch.heads  # fewer than N: repeated (ALST)
    q, kv = arch.heads * arch.head_dim, kv_heads * arch.head_dim
    norms = 2 * (4 * h + 4)
    attention = e * (2 * q + 2 * kv) + 4 * arch.heads
    mlp = (3 if arch.gated else 2) * e * i * (arch.active_experts if arch.experts else 1)  # MoE: each token's top-k experts
    targets = resolve_targets(arch.inventory, setup)
    # Summed over every layer and averaged: layers differ (dense first layers, linear attention).
    adapted = [(name, n_in) for name, n_in, _ in arch.linears if name in targets.modules]
    lora = {False: 0.0, True: 0.0}  # outside / inside the MLP
    for name, _ in adapted:  # lora_A outputs
        lora[name in MLP_LINEARS] += e * setup.rank
    if setup.precision == "fp32":
        # No casts: LoRA layers reading the same input (q/k/v, gate/up) share one saved tensor.
        groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
        shared: dict[tuple, dict[str, int]] = {}
        for name, n_in in adapted:
            group = next((g for g in groups if name in g), None)
            if group is None:
                lora[name in MLP_LINEARS] += e * n_in
            else:
                members = shared.setdefault(group, {})
                members[name] = members.get(name, 0) + n_in
        for group, members in shared.items():
            lora[group[0] in MLP_LINEARS] += e * max(members.values())
    else:
        # Under autocast peft recasts the input of each LoRA layer: one copy per layer.
        for name, n_in in adapted:
            lora[name in MLP_LINEARS] += e * n_in
    # Fused expert tensors: each token's input and rank-r middle, per active expert.
    experts = [shape for path, shape in arch.tensors if path in targets.parameters and len(shape) == 3]
    lora[True] += sum(e * (shape[2] + setup.rank) * arch.active_experts for shape in experts)
    return norms + attention + lora[False] / arch.layers, mlp + lora[True] / arch.layers


def layer_activation_bytes_per_token(arch: Architecture, setup: Setup) -> float:
    """What a decoder layer saves for backward per token. A tiled MLP (--tiled-mlp) keeps only its
    input; its tiles' activations exist one tile at a time (`activation_bytes`)."""
    rest, mlp = layer_terms_per_token(arch, setup)
    return rest + (ELEMENT[setup.precision] * arch.hidden if setup.mlp_tiles > 1 else mlp)


def recomputed_layers(arch: Architecture, setup: Setup) -> int:
    """Decoder layers whose forward runs again in backward (gradient checkpointing)."""
    return arch.layers - min(setup.kept_layers, arch.layers) if setup.gradient_checkpointing else 0


def transient_bytes(arch: Architecture, setup: Setup) -> int:
    """Working memory inside one layer on top of what it saves: one MLP tile's recomputed activations
    (--tiled-mlp; measured on a CPU the tiled step peaks up to a quarter below this plan: it is
    conservative), and sequence parallelism's all-to-all: a send and a receive buffer per
    size exchanged (q and the attention output; k and v when their heads are not repeated), kept for
    the run (lora_tune.models.sequence_parallel), and the joined tensor being made, in the compute dtype."""
    e = ELEMENT[setup.precision]
    extra = 0
    if setup.mlp_tiles > 1:
        _, mlp = layer_terms_per_token(arch, setup)
        extra += int(mlp * math.ceil(setup.tokens / setup.mlp_tiles))
    if setup.sequence_parallel > 1:
        kv_heads = arch.kv_heads if arch.kv_heads % setup.sequence_parallel == 0 else arch.heads
        sizes = {e * arch.heads * arch.head_dim * setup.tokens, e * kv_heads * arch.head_dim * setup.tokens}
        extra += 2 * sum(sizes) + max(sizes)
    return extra


MASKED_ATTENTION = ("sdpa", "sdpa_packed", "eager")


def mask_bytes(setup: Setup) -> tuple[int, int]:
    """(kept through the step, peak while built) of the attention mask transformers builds for
    masked attention over packed or padded rows: one bool per query and key position per row, kept
    for every layer (and their recomputation); building it takes three such grids (the causal and
    the same-sample conditions, then their conjunction). Measured on a CPU, one 8,192-token row of 4
    samples: the step's tensor peak was 194 MiB, three 64 MiB grids."""
    if setup.attention not in MASKED_ATTENTION:
        return 0, 0
    rows = setup.tokens // setup.row_tokens
    kept = rows * setup.row_tokens**2
    return kept, 3 * kept


def attention_scores_bytes(arch: Architecture, setup: Setup) -> int:
    """Eager attention's scores per layer: the softmax's probabilities (compute dtype, kept for
    backward) and its fp32 input, [rows x heads x tokens x tokens]; under sequence parallelism each
    rank holds 1/N of the heads over the whole row."""
    if setup.attention.removeprefix("ulysses_") != "eager":
        return 0
    rows = setup.tokens // setup.row_tokens
    whole_row = setup.row_tokens * setup.sequence_parallel
    return rows * arch.heads // setup.sequence_parallel * whole_row**2 * (ELEMENT[setup.precision] + 4)


def activation_bytes(arch: Architecture, setup: Setup) -> tuple[int, int]:
    """(saved for backward, peak during backward) for one micro-batch on one rank, logits excluded."""
    e = ELEMENT[setup.precision]
    rope = 2 * e * arch.head_dim * setup.row_tokens
    full_layer = int(layer_activation_bytes_per_token(arch, setup) * setup.tokens) + rope + attention_scores_bytes(arch, setup)
    final_norm = (4 * arch.hidden + 4) * setup.tokens
    recomputed = recomputed_layers(arch, setup)
    whole = (arch.layers - recomputed) * full_layer + final_norm  # layers that keep all their activations
    transient = transient_bytes(arch, setup)
    mask, building = mask_bytes(setup)
    if not recomputed:
        return whole + mask, max(whole + transient + mask, building)
    # Each checkpointed layer keeps its input (on the host with activation offload); one is rebuilt at a time.
    inputs = 0 if setup.activation_offload else recomputed * e * arch.hidden * setup.tokens
    # The layers that keep their activations are the last ones (lora_tune.models.adapter): backward reaches
    # them first and frees theirs before it rebuilds a checkpointed layer, so a rebuilt layer adds to
    # the peak only when no layer keeps its activations (measured: keeping 1 of 4 layers peaks as
    # keeping none, each further kept layer adds one layer's activations).
    return whole + inputs + mask, max(max(whole, final_norm + full_layer) + inputs + transient + mask, building)


def logits_bytes(arch: Architecture, setup: Setup) -> tuple[int, int]:
    """(saved between forward and backward, peak). Full logits: the loss keeps the fp32 upcast (and
    labels); backward adds the fp32 gradient while the compute-dtype logits exist: (8 + e) V per
    token. Chunked (lora_tune.models.head): one chunk of logits at a time in the compute dtype, fp32 and the
    fp32 softmax gradient, and the hidden-size gradient kept from forward to backward."""
    tokens = setup.tokens
    e = ELEMENT[setup.precision]
    if setup.loss_chunk_size != 0:
        chunk = min(setup.loss_chunk_size or auto_chunk_size(tokens, arch.hidden, arch.vocab), tokens)
        kept = tokens * arch.hidden * e + tokens * 8  # gradient w.r.t. the hidden states, labels
        return kept, kept + chunk * arch.vocab * (e + 8)
    return tokens * (4 * arch.vocab + 8), tokens * (8 + e) * arch.vocab


def generation_bytes(arch: Architecture, setup: Setup) -> int:
    """Online RL's rollout on this device, no gradient: the KV cache of every completion at full
    length, and one decoding step's scores (compute dtype from the head, then fp32 while sampling:
    the tempered scores, their softmax, and probabilities over the noise). A colocated vLLM holds
    its own copy of the base (the checkpoint's weights in bf16, fp32 for an fp32 run) beside its
    cache; a vLLM server generates elsewhere, which this device doesn't hold."""
    if not setup.rollout_sequences or setup.rollout == "vllm-server":
        return 0
    e = ELEMENT[setup.precision]
    longest = setup.max_seq_len + setup.new_tokens + setup.turn_tokens  # the longest episode (lora_tune.training.episodes)
    cache = setup.rollout_sequences * longest * arch.layers * 2 * arch.kv_heads * arch.head_dim * e
    if setup.rollout == "vllm-colocate":
        return cache + base_weight_bytes(arch, "fp32" if setup.precision == "fp32" else "bf16")[0]
    return cache + setup.rollout_sequences * arch.vocab * (e + 3 * 4)


# --- the estimate ------------------------------------------------------------------------------
def estimate(arch: Architecture, setup: Setup) -> Estimate:
    spec = engines.BACKENDS[setup.backend]
    if setup.zero not in spec.stages:
        raise ValueError(f"{setup.backend} has no stage {setup.zero}; a Setup names the backend that runs it")
    states = model_states(arch, setup)
    placed = spec.place(states, setup.zero, setup.offload, setup.world)
    device = placed.device
    tower_device, tower_host = vision.placed(spec, states, setup, vision_weight_bytes(arch, setup.precision)) if arch.vision else (0, 0)
    host = {
        "offloaded_optimizer_bytes": placed.host_optimizer * setup.gpus,
        "offloaded_weights_bytes": (placed.host_weights + tower_host) * setup.gpus,
        "offloaded_activations_bytes": (
            setup.gpus * recomputed_layers(arch, setup) * ELEMENT[setup.precision] * arch.hidden * setup.tokens
            if setup.activation_offload
            else 0
        ),
        # Each process streams the checkpoint shard by shard (or layer by layer, which is less).
        "loading_bytes": setup.gpus * min(SHARD_BYTES, base_weight_bytes(arch, "bf16")[0] + vision_weight_bytes(arch, "bf16")),
    }
    host["total_bytes"] = sum(host.values())
    saved_act, peak_act = activation_bytes(arch, setup)
    saved_logits, peak_logits = logits_bytes(arch, setup)
    # LoRA weights recast to the compute dtype by autocast, plus allocator slack.
    overhead = CUDA_CONTEXT + ELEMENT[setup.precision] * states.trainable_params
    per_device = {
        "weights_bytes": device.weights,
        **({"vision_tower_bytes": tower_device} if arch.vision else {}),
        "trainable_bytes": device.trainable,
        "gradients_bytes": device.gradients,
        "optimizer_bytes": device.optimizer,
        **({"adapter_fixed_bytes": setup.adapter_fixed_bytes} if setup.adapter_fixed_bytes else {}),
        "activations_bytes": peak_act,
        "logits_bytes": peak_logits,
        **(
            {"images_bytes": vision.images_bytes(arch.vision, setup, ELEMENT[setup.precision], peak_act + peak_logits)}
            if arch.vision
            else {}
        ),
        # Generation's working set where it exceeds training's (they never coexist).
        **({"generation_bytes": max(0, generation_bytes(arch, setup) - peak_act - peak_logits)} if generation_bytes(arch, setup) else {}),
        "overhead_bytes": overhead,
    }
    per_device["total_bytes"] = sum(per_device.values())
    return Estimate(states.trainable_params, per_device, host, saved_act + saved_logits)
