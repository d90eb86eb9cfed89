"""The memory model: model states byte-exact after a real step, activations within 10% of what
autograd really saves, hand-checked 70B figures, and how each backend's placement divides them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import lora_tune
from lora_tune.config import TrainConfig
from lora_tune.data.batching import collate
from lora_tune.data.prepare import Sample
from lora_tune.engines.single import SingleDeviceEngine
from lora_tune.models.adapter import Checkpointing, add_lora
from lora_tune.models.loading import compute_dtype, load_base_model, load_config, load_tokenizer
from lora_tune.models.targets import lora_targets, token_ids
from lora_tune.models.tiny.model import build_tiny_llama
from lora_tune.planner import memory as plan
from lora_tune.planner.architecture import load_architecture
from lora_tune.planner.measured import cpu_tensor_peak
from lora_tune.training.objectives.sft import CausalLMLoss

from helpers import run_cli

LLAMA3_70B = load_architecture("llama-70b")


def plan_json(capsys, *args) -> dict:
    code, out, err = run_cli(["plan", *args, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def test_llama3_70b_hand_checked_figures(capsys):
    result = plan_json(capsys, "--base", "llama-70b", "--rank", "16", "--precision", "bf16")
    # r * sum(in + out) over q,k,v,o,gate,up,down = 16 * 161,792 per layer, 80 layers.
    assert result["trainable_parameters"] == 207_093_760
    assert result["per_device"]["weights_bytes"] == pytest.approx(141.1e9, rel=0.005)  # 70.55B x 2 B
    assert set(result) >= {"trainable_parameters", "per_device", "host", "fits"}
    assert list(result["per_device"]) == [
        *"weights_bytes trainable_bytes gradients_bytes optimizer_bytes activations_bytes logits_bytes overhead_bytes total_bytes".split(),
    ]
    assert result["per_device"]["total_bytes"] == sum(v for k, v in result["per_device"].items() if k != "total_bytes")
    assert result["fits"] is False  # 141 GB of weights don't fit one 80 GB card


def test_nf4_double_quant_is_4_127_bits_per_quantised_weight():
    n_in, n_out = 8192, 28672
    bits = 8 * plan.quantized_weight_bytes(n_in, n_out, "4bit") / (n_in * n_out)
    assert bits == pytest.approx(4.127, abs=0.001)
    assert plan.quantized_weight_bytes(n_in, n_out, "8bit") == n_in * n_out + 4 * n_out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero3_divides_the_sharded_states_by_the_world_size(n, capsys):
    single = plan_json(capsys, "--base", "llama-70b", "--precision", "bf16")["per_device"]
    sharded = plan_json(capsys, "--base", "llama-70b", "--precision", "bf16", "--zero", "3", "--gpus", str(n))["per_device"]
    _, layer = plan.base_weight_bytes(LLAMA3_70B, "bf16")
    assert sharded["weights_bytes"] - layer == pytest.approx(single["weights_bytes"] / n, abs=1)
    for key in ("trainable_bytes", "gradients_bytes", "optimizer_bytes"):
        assert sharded[key] == pytest.approx(single[key] / n, abs=1), key
    zero2 = plan_json(capsys, "--base", "llama-70b", "--precision", "bf16", "--zero", "2", "--gpus", str(n))["per_device"]
    assert zero2["weights_bytes"] == single["weights_bytes"] and zero2["gradients_bytes"] == pytest.approx(
        single["gradients_bytes"] / n, abs=1
    )


@pytest.mark.parametrize("n", [2, 8])
def test_zero1_and_fsdp_shard_what_they_shard(n, capsys):
    single = plan_json(capsys, "--base", "llama-70b", "--precision", "bf16")["per_device"]
    zero1 = plan_json(capsys, "--base", "llama-70b", "--precision", "bf16", "--zero", "1", "--gpus", str(n))["per_device"]
    assert zero1["optimizer_bytes"] == pytest.approx(single["optimizer_bytes"] / n, abs=1)
    assert zero1["gradients_bytes"] == single["gradients_bytes"] and zero1["weights_bytes"] == single["weights_bytes"]
    fsdp = plan_json(capsys, "--base", "llama-70b", "--precision", "bf16", "--backend", "fsdp", "--gpus", str(n))["per_device"]
    _, layer = plan.base_weight_bytes(LLAMA3_70B, "bf16")
    # Its own shard plus two unsharded layers: the one computing and the one being prefetched.
    assert fsdp["weights_bytes"] - 2 * layer == pytest.approx(single["weights_bytes"] / n, abs=1)
    for key in ("trainable_bytes", "gradients_bytes", "optimizer_bytes"):
        assert fsdp[key] == pytest.approx(single[key] / n, abs=1), key
    offloaded = plan_json(capsys, *"--base llama-70b --precision 4bit --backend fsdp --offload cpu --gpus".split(), str(n))
    _, layer4 = plan.base_weight_bytes(LLAMA3_70B, "4bit")
    device = offloaded["per_device"]
    assert (
        device["weights_bytes"] == 2 * layer4 and device["optimizer_bytes"] == device["gradients_bytes"] == device["trainable_bytes"] == 0
    )
    whole4, _ = plan.base_weight_bytes(LLAMA3_70B, "4bit")
    assert offloaded["host"]["offloaded_weights_bytes"] == pytest.approx(whole4, abs=n)  # every rank's shard, on the host


def test_qlora_70b_on_two_24gb_gpus_fits_with_fsdp_and_offload(capsys):
    """Answer.AI's FSDP+QLoRA setup: Llama-2-70B on 2 x 24 GB with CPU offload (their 14.9 GiB peak)."""
    setup = "--base llama2-70b --precision 4bit --backend fsdp --offload cpu --gpus 2 --gpu-memory rtx4090"
    setup += " --max-seq-len 2048 --micro-batch-size 2"
    result = plan_json(capsys, *setup.split())
    assert result["fits"] is True and result["per_device"]["total_bytes"] < 20 * plan.GIB


def _measured_model_states(model, engine) -> dict[str, int]:
    def nbytes(t):
        return t.numel() * t.element_size()

    weights = 0
    for p in model.parameters():
        if p.requires_grad:
            continue
        weights += nbytes(p)
        qs = getattr(p, "quant_state", None)
        if qs is not None:  # NF4: absmax, code, and the double-quantisation state
            weights += nbytes(qs.absmax) + nbytes(qs.code) + nbytes(qs.offset) + nbytes(qs.state2.absmax) + nbytes(qs.state2.code)
        scb = getattr(p, "SCB", None)
        if scb is not None:
            weights += nbytes(scb)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = sum(nbytes(v) for state in engine.optimizer.state.values() for v in state.values() if torch.is_tensor(v)) if engine else 0
    return {
        "weights_bytes": weights,
        "trainable_bytes": sum(nbytes(p) for p in trainable),
        "optimizer_bytes": optimizer,
    }


@pytest.mark.parametrize("precision,optim", [("bf16", "adamw"), ("fp32", "adamw_8bit"), ("4bit", "adamw_8bit"), ("8bit", "adamw")])
def test_model_states_are_exact(precision, optim, tiny_model):
    # rank 48: LoRA B of the MLP down projection (64 x 48 = 3072) stays 32-bit in 8-bit Adam,
    # A of gate/up (48 x 128 = 6144) goes 8-bit, so both branches of the rule are exercised.
    cfg = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision=precision, optim=optim, rank=48, max_seq_len=32)
    model = add_lora(load_base_model(str(tiny_model), precision, torch.device("cpu")), cfg, "b")
    weights_at_load = _measured_model_states(model.base_model.model, None)["weights_bytes"]
    engine = SingleDeviceEngine(cfg, torch.device("cpu"))
    engine.prepare(CausalLMLoss(model, cfg.loss_chunk_size), total_steps=2)
    batch = collate([[Sample(list(range(3, 30)), list(range(3, 30)))]], pad_id=0, packed=False)
    engine.forward_backward(batch, 26)
    grads_kept = {id(p): p.grad.clone() for p in model.parameters() if p.requires_grad}
    measured_grads = sum(g.numel() * g.element_size() for g in grads_kept.values())
    engine.step()
    # LLM.int8 keeps its row scales (SCB) on the weight until the first forward moves them into
    # the layer's state, so the weights are measured as loaded.
    measured = _measured_model_states(model.base_model.model, engine) | {
        "gradients_bytes": measured_grads,
        "weights_bytes": weights_at_load,
    }
    estimate = plan.estimate(load_architecture(str(tiny_model)), plan.setup_from(cfg))
    for key, value in measured.items():
        assert estimate.per_device[key] == value, key


@pytest.mark.parametrize(
    "adapter",
    [
        {"peft_type": "oft"},
        {"peft_type": "boft"},
        {"peft_type": "loha"},
        {"peft_type": "vera"},
        {"peft_type": "ia3"},
        {"peft_type": "adalora"},
        {"rank_pattern": [r".*\.q_proj=16"]},
        {"layers_to_transform": [1]},
        {"modules_to_save": ["lm_head"]},
        {"trainable_tokens": ["What", "even"]},
    ],
    ids=lambda a: "-".join(map(str, a.items())),
)
def test_an_adapter_that_is_not_a_uniform_lora_is_planned_as_peft_builds_it(adapter, tiny_model):
    """Another --peft-type, a rank pattern, a layer list, modules kept in full, trainable tokens: the plan
    counts what peft trains (plan and train agree), not a LoRA of --rank on every target."""
    cfg = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision="fp32", rank=4, **adapter)
    config = load_config(str(tiny_model), False)
    tokens = token_ids(cfg, load_tokenizer(str(tiny_model), False))
    model = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, "b", lora_targets(cfg, config, tokens))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plain = plan.estimate(load_architecture(str(tiny_model)), plan.setup_from(cfg)).trainable_parameters
    planned = lora_tune.plan(base=str(tiny_model), precision="fp32", rank=4, **adapter).estimate.trainable_parameters
    assert planned == trained and trained != plain  # the shapes alone would have counted a uniform LoRA of rank 4


def test_boft_s_permutation_matrices_are_planned_whole_on_every_rank(tiny_model):
    """BOFT keeps an fp32 permutation matrix of each adapted layer's input beside its trained blocks (peft
    can't build it on the planner's meta skeleton, so BOFT declares its terms): the plan counts the bytes
    the built model holds, on every rank whatever the backend shards."""
    cfg = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision="fp32", rank=4, peft_type="boft")
    model = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, "b")
    held = sum(b.nbytes for name, b in model.named_buffers() if name.endswith("boft_P"))
    assert held > 0
    for sharded in ({}, {"zero": 3, "gpus": 2}, {"backend": "fsdp", "gpus": 2}):
        estimate = lora_tune.plan(base=str(tiny_model), precision="fp32", rank=4, peft_type="boft", **sharded).estimate
        assert estimate.per_device["adapter_fixed_bytes"] == held, sharded


def _saved_bytes(tiny_model, precision: str, checkpointing: bool, seq: int, batch: int, chunk: int, kept: int = 0) -> int:
    """Bytes autograd keeps for backward during one forward through the training loss (parameters
    and their casts excluded); `kept`: checkpointed decoder layers that keep their activations."""
    cfg = TrainConfig(
        base=str(tiny_model), data="d", output_dir="o", precision=precision, rank=8, gradient_checkpointing=checkpointing, dropout=0.0
    )
    base = load_base_model(str(tiny_model), precision, torch.device("cpu"))
    model = CausalLMLoss(add_lora(base, cfg, "b", checkpointing=Checkpointing(checkpointing, kept)), chunk)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    small = 0
    seen: dict[int, int] = {}

    def pack(t):
        nonlocal small
        key = t.untyped_storage().data_ptr()
        if key in params:
            return t
        # Weight-shaped casts made by autocast (LoRA A/B in bf16) are parameter copies, not activations.
        if t.dim() == 2 and min(t.shape) == cfg.rank and max(t.shape) != seq * batch:
            small += t.untyped_storage().nbytes()
            return t
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=compute_dtype(precision)) if precision != "fp32" else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(input_ids=ids, labels=ids, num_items_in_batch=ids.numel())
    return sum(seen.values())


@pytest.mark.parametrize("chunk", [1024, 0], ids=["chunked-loss", "full-logits"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_within_10_percent_of_saved_tensors(precision, checkpointing, chunk, tiny_model):
    seq, batch = 128, 2
    measured = _saved_bytes(tiny_model, precision, checkpointing, seq, batch, chunk)
    setup = plan.Setup(
        precision=precision, rank=8, micro_batch_size=batch, max_seq_len=seq, gradient_checkpointing=checkpointing, loss_chunk_size=chunk
    )
    planned = plan.estimate(load_architecture(str(tiny_model)), setup).saved_activations_bytes
    assert planned == pytest.approx(measured, rel=0.10), (planned, measured)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_layer_kept_out_of_checkpointing_keeps_what_the_plan_says(precision, tiny_model):
    """Partial checkpointing (--gradient-checkpointing auto): one of the two layers recomputed, the
    other keeping its activations; measured between the all and none cases, as planned."""
    seq, batch = 128, 2
    measured = {kept: _saved_bytes(tiny_model, precision, True, seq, batch, 1024, kept) for kept in (0, 1, 2)}
    assert measured[0] < measured[1] < measured[2]
    arch = load_architecture(str(tiny_model))
    for kept, value in measured.items():
        setup = plan.Setup(precision=precision, rank=8, micro_batch_size=batch, max_seq_len=seq, kept_layers=kept, loss_chunk_size=1024)
        assert plan.estimate(arch, setup).saved_activations_bytes == pytest.approx(value, rel=0.10), kept
    everything = plan.Setup(precision=precision, rank=8, micro_batch_size=batch, max_seq_len=seq, gradient_checkpointing=False)
    assert (
        plan.estimate(arch, everything).saved_activations_bytes
        == plan.estimate(arch, replace(everything, gradient_checkpointing=True, kept_layers=2)).saved_activations_bytes
    )


@pytest.fixture(scope="module")
def tiny_four_layers(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4-layers"), num_hidden_layers=4)


def test_planned_peak_within_10_percent_of_measured_for_every_split(tiny_four_layers):
    """The plan's peak (activations + logits) against the peak of live tensor bytes of a training
    step, measured from the allocator's records, for 0..4 of 4 layers keeping their activations.
    The layers kept are the last ones, which backward frees before it rebuilds a checkpointed layer:
    keeping one costs no more than recomputing every layer, each further one adds a layer."""
    seq, batch, layers = 256, 4, 4
    arch = load_architecture(str(tiny_four_layers))
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(0))
    measured, planned = {}, {}
    for kept in range(layers + 1):
        checkpointing = Checkpointing(True, kept) if kept < layers else Checkpointing(False)
        cfg = TrainConfig(base=str(tiny_four_layers), data="d", output_dir="o", precision="fp32", rank=8, dropout=0.0)
        base = load_base_model(str(tiny_four_layers), "fp32", torch.device("cpu"))
        model = CausalLMLoss(add_lora(base, cfg, "b", checkpointing=checkpointing), None)
        model.train()
        model(input_ids=ids, labels=ids, num_items_in_batch=ids.numel()).backward()  # LoRA grads exist from here on
        with cpu_tensor_peak() as peak:
            model(input_ids=ids, labels=ids, num_items_in_batch=ids.numel()).backward()
        measured[kept] = peak.bytes
        setup = plan.Setup(precision="fp32", rank=8, micro_batch_size=batch, max_seq_len=seq)
        setup = replace(setup, gradient_checkpointing=kept < layers, kept_layers=kept % layers)
        planned[kept] = plan.activation_bytes(arch, setup)[1] + plan.logits_bytes(arch, setup)[1]
    for kept in measured:
        assert planned[kept] == pytest.approx(measured[kept], rel=0.10), (kept, planned, measured)
    assert measured[1] <= measured[0] * 1.05 and planned[1] <= planned[0]  # the last layer kept for free
    assert measured[0] < measured[2] < measured[3] < measured[4]


def test_a_cpu_pass_is_planned_as_the_full_rows_it_holds(tiny_four_layers):
    """On a CPU a micro-batch runs in passes of whole rows (lora_tune.data.batching.passes): the plan's
    activations and logits are those of a micro-batch of the rows a pass holds (a row at least); the
    model states are the micro-batch's."""
    arch = load_architecture(str(tiny_four_layers))
    whole = plan.Setup(precision="fp32", rank=8, micro_batch_size=4, max_seq_len=512, kept_layers=1)
    passes = replace(whole, pass_tokens=1024)
    two_rows = replace(whole, micro_batch_size=2)
    assert (whole.tokens, passes.tokens, replace(whole, pass_tokens=100).tokens) == (2048, 1024, 512)
    assert plan.activation_bytes(arch, passes) == plan.activation_bytes(arch, two_rows)
    assert plan.logits_bytes(arch, passes) == plan.logits_bytes(arch, two_rows)
    planned = plan.estimate(arch, passes).per_device
    assert planned == plan.estimate(arch, two_rows).per_device
    assert planned["activations_bytes"] < plan.estimate(arch, whole).per_device["activations_bytes"]


def test_checkpointing_cuts_planned_activations_for_a_70b():
    with_ckpt = plan.activation_bytes(LLAMA3_70B, plan.Setup(gradient_checkpointing=True))[0]
    without = plan.activation_bytes(LLAMA3_70B, plan.Setup(gradient_checkpointing=False))[0]
    assert without / with_ckpt > 10


@pytest.mark.parametrize("precision", ["8bit", "4bit"])
def test_quantized_bases_under_zero3_are_partitioned_while_loading(precision, capsys):
    """Streamed layer by layer into ZeRO-3, a quantized 70B never sits whole on a GPU: the plan's
    peak is the steady state (a shard plus a gathered layer), so QLoRA of a 70B over 2 x 24 GB with
    CPU offload fits (loading it whole took 37 GB per GPU), and an 8-bit 70B over 8 x 80 GB needs
    ~1/8 of its 70 GB per GPU."""
    arch = load_architecture("llama-70b")
    whole = plan.base_weight_bytes(arch, precision)[0]
    gpus = 2 if precision == "4bit" else 8
    sharded = plan.estimate(arch, plan.Setup(precision=precision, backend="deepspeed", zero=3, gpus=gpus, max_seq_len=512))
    layer = plan.base_weight_bytes(arch, precision)[1]
    assert sharded.per_device["weights_bytes"] == pytest.approx(whole / gpus + layer, abs=1)
    assert sharded.per_device["total_bytes"] < whole / gpus + 6 * plan.GIB
    if precision == "4bit":
        result = plan_json(
            capsys,
            *"--base llama-70b --precision 4bit --zero 3 --offload cpu --gpus 2 --gpu-memory rtx4090 --max-seq-len 2048".split(),
        )
        assert result["fits"] is True
    bf16 = plan.estimate(arch, plan.Setup(precision="bf16", backend="deepspeed", zero=3, gpus=8, max_seq_len=512))
    assert bf16.per_device["total_bytes"] < plan.base_weight_bytes(arch, "bf16")[0] / 4  # zero.Init: never whole


@pytest.mark.parametrize("rollout", ["transformers", "vllm"])
def test_the_rollout_cache_counts_the_longest_episode_with_tools(rollout):
    """With tools a later turn decodes up to --max-new-tokens after the prompt and the completion so far
    (itself within --max-new-tokens, tool results included), rows left-padded to the longest: the
    cache of each completion grows by --max-new-tokens positions; a colocated vLLM pages sequences alone."""
    grpo = dict(base="llama-70b", data="x.jsonl", output_dir="o", objective="grpo", reward=["r.py:f"], max_seq_len=512)
    grpo.update(max_new_tokens=256, num_generations=4, micro_batch_size=4, grad_accum=2, rollout=rollout)
    if rollout == "vllm":
        grpo["vllm_mode"] = "colocate"
    plain, agent = (plan.setup_from(TrainConfig(**grpo, **extra)) for extra in ({}, {"tools": ["t.py:calc"], "max_tool_calls": 3}))
    arch = LLAMA3_70B
    per_position = 8 * arch.layers * 2 * arch.kv_heads * arch.head_dim * 2  # 8 completions, bf16
    grown = plan.generation_bytes(arch, agent) - plan.generation_bytes(arch, plain)
    assert grown == (256 * per_position if rollout == "transformers" else 0)
    assert plain.turn_tokens == 0 and agent.turn_tokens == (256 if rollout == "transformers" else 0)
