"""GRPO's loss module (lora_tune/training/objectives/grpo.py): a step of two micro-batches equals TRL's
own `GRPOTrainer._compute_loss` on the same completions (loss, every LoRA gradient, the metrics) for
each loss type, importance-sampling level, with and without the KL term, on- and off-policy; packed
rows equal padded ones, the chunked head equals the full logits, and the scoring passes record the
policy's and the reference's per-token log-probabilities."""

from __future__ import annotations

import collections
import copy
import itertools
import types

import pytest
import torch

from lora_tune.data.batching import collate
from lora_tune.models.head import IGNORE
from lora_tune.training.objectives.grpo import GRPOLoss

from helpers import adapted_tiny_model

trl = pytest.importorskip("trl")
trl_utils = pytest.importorskip("trl.trainer.utils")

EPSILON, EPSILON_HIGH, TEMPERATURE, MAX_NEW_TOKENS = 0.2, 0.28, 0.7, 8
PAD = 0
# Two micro-batches of three completions each: (prompt length, completion length), all different,
# so left and right padding, packing and every normaliser matter.
SHAPES = [[(3, 4), (5, 1), (2, 6)], [(4, 2), (2, 7), (3, 3)]]
# Completion tokens kept out of the loss (TRL's tool_mask; ours: labels IGNORE): (micro-batch, completion, token)
TOOL_MASKED = {(0, 2, 2), (0, 2, 3), (1, 1, 0)}
TRL_METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def config(loss_type="dapo", importance_sampling="token", beta=0.0):
    return types.SimpleNamespace(
        loss_type=loss_type,
        importance_sampling=importance_sampling,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        beta=beta,
        temperature=TEMPERATURE,
        max_new_tokens=MAX_NEW_TOKENS,
    )


@pytest.fixture(scope="module")
def start(tiny_model):
    """The tiny model with an adapter whose B is not zero (so it changes the model)."""
    return adapted_tiny_model(tiny_model).train()


# --- the completions, as TRL holds them and as our micro-batches do ---------------------------------
def trl_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, compute_aux_loss=False, **_):
    """TRL's `_get_per_token_logps_and_entropies` without its fused head: the model on [prompt | completion],
    the logits of the completion tokens divided by the temperature, TRL's own log-softmax and entropy."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, -logits_to_keep - 1 : -1] / TEMPERATURE
    logps = trl_utils.selective_log_softmax(logits, input_ids[:, -logits_to_keep:])
    return logps, trl_utils.entropy_from_logits(logits) if compute_entropy else None, None


@pytest.fixture(scope="module")
def rollout(start):
    """Per micro-batch: TRL's inputs (prompts padded on the left, completions on the right, [B, T] old
    and reference log-probabilities perturbed from the policy's, so ratios leave the clip region) and
    the same as our samples, advantages and [L] log-probabilities in label order."""
    g = torch.Generator().manual_seed(3)
    vocab = start.get_base_model().config.vocab_size
    batches = []
    for m, shapes in enumerate(SHAPES):
        prompts = [torch.randint(3, vocab, (p,), generator=g) for p, _ in shapes]
        completions = [torch.randint(3, vocab, (c,), generator=g) for _, c in shapes]
        width_p, width_c = max(p for p, _ in shapes), max(c for _, c in shapes)
        trl_inputs = {
            "prompt_ids": torch.full((len(shapes), width_p), PAD),
            "prompt_mask": torch.zeros(len(shapes), width_p, dtype=torch.long),
            "completion_ids": torch.full((len(shapes), width_c), PAD),
            "completion_mask": torch.zeros(len(shapes), width_c, dtype=torch.long),
            "tool_mask": torch.ones(len(shapes), width_c, dtype=torch.long),
            "advantages": torch.randn(len(shapes), generator=g),
        }
        samples = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            trl_inputs["prompt_ids"][i, width_p - prompt.numel() :] = prompt
            trl_inputs["prompt_mask"][i, width_p - prompt.numel() :] = 1
            trl_inputs["completion_ids"][i, : completion.numel()] = completion
            trl_inputs["completion_mask"][i, : completion.numel()] = 1
            labels = completion.clone()
            for j in range(completion.numel()):
                if (m, i, j) in TOOL_MASKED:
                    trl_inputs["tool_mask"][i, j] = 0
                    labels[j] = IGNORE
            samples.append(
                types.SimpleNamespace(
                    input_ids=[*prompt.tolist(), *completion.tolist()],
                    labels=[IGNORE] * prompt.numel() + labels.tolist(),
                    starts=[0],
                    label=0,
                    reference=None,
                )
            )
        with torch.no_grad():
            current, _, _ = trl_logps_and_entropies(
                start,
                torch.cat([trl_inputs["prompt_ids"], trl_inputs["completion_ids"]], 1),
                torch.cat([trl_inputs["prompt_mask"], trl_inputs["completion_mask"]], 1),
                width_c,
            )
        # Each completion's ratio moved 0.4 in log space, towards the clip boundary on the side of its
        # advantage for every other one (so whole sequences are clipped too), plus per-token noise.
        side = torch.tensor([(-1.0) ** i for i in range(len(shapes))]) * trl_inputs["advantages"].sign()
        trl_inputs["old_per_token_logps"] = current - 0.4 * side.unsqueeze(1) + 0.3 * torch.randn(current.shape, generator=g)
        trl_inputs["ref_per_token_logps"] = current + 0.2 * torch.randn(current.shape, generator=g)
        loss_mask = (trl_inputs["completion_mask"] * trl_inputs["tool_mask"]).bool()
        ours = {
            "advantages": trl_inputs["advantages"].clone(),
            "old_logps": trl_inputs["old_per_token_logps"][loss_mask],  # row by row: the order of our label tokens
            "ref_logps": trl_inputs["ref_per_token_logps"][loss_mask],
            "current": current[loss_mask],
        }
        batches.append((trl_inputs, samples, ours))
    tokens = sum(int((t["completion_mask"] * t["tool_mask"]).sum()) for t, _, _ in batches)
    for trl_inputs, _, _ in batches:
        trl_inputs["num_items_in_batch"] = torch.tensor(tokens)  # TRL: the generation batch's loss tokens
    return batches, tokens


def our_inputs(samples, packed: bool) -> dict:
    """The data layer's micro-batch of these completions: one packed row (positions restarting per
    completion, no attention mask) or one row each (right-padded, with a mask)."""
    inputs = collate([samples] if packed else [[s] for s in samples], PAD, packed, units=True).inputs
    return {k: inputs[k] for k in ("input_ids", "labels", "sequence_ids", "attention_mask", "position_ids") if k in inputs}


def trl_self(model, loss_type, importance_sampling, beta):
    """What `GRPOTrainer._compute_loss` reads of its trainer: ours, on one process, two accumulation
    steps per optimizer step and a generation batch of two micro-batches."""
    return types.SimpleNamespace(
        loss_type=loss_type,
        importance_sampling_level=importance_sampling,
        beta=beta,
        epsilon_low=EPSILON,
        epsilon_high=EPSILON_HIGH,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        max_completion_length=MAX_NEW_TOKENS,
        current_gradient_accumulation_steps=len(SHAPES),
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=len(SHAPES)),
        model=model,
        accelerator=types.SimpleNamespace(
            num_processes=1, reduce=lambda t, reduction="sum": t, gather=lambda t: t, gather_for_metrics=lambda t: t, sync_gradients=True
        ),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        _get_per_token_logps_and_entropies=trl_logps_and_entropies,
    )


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def difference(got, expected) -> float:
    """Absolute difference, relative where the expected values are above 1."""
    got, expected = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return float((got - expected).abs().max()) / max(1.0, float(expected.abs().max()))


def assert_same_grads(got: dict, expected: dict, case: str) -> None:
    """Within 1e-6 (relative above 1), and within 1e-5 of each tensor's largest entry: the LoRA gradients
    here are 1e-4 to 1e-1, so the absolute bound alone would let a small one be wrong."""
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert difference(grad, expected[name]) <= 1e-6, f"{case}: {name}"
        assert float((grad - expected[name]).abs().max()) <= 1e-5 * float(expected[name].abs().max()), f"{case}: {name}"


def our_step(start, rollout, cfg, packed: bool, chunk_size, old: bool):
    """Our loss over the step's micro-batches, summed and backpropagated: (loss, LoRA grads, each micro-batch's metrics)."""
    batches, tokens = rollout
    model = copy.deepcopy(start)
    loss_module = GRPOLoss(model, chunk_size, cfg)
    total, stats = 0.0, []
    for _, samples, ours in batches:
        loss = loss_module(
            **our_inputs(samples, packed),
            advantages=ours["advantages"],
            num_items_in_batch=torch.tensor(float(sum(len(s) for s in SHAPES))),
            tokens_in_step=torch.tensor(float(tokens)),
            old_logps=ours["old_logps"] if old else None,
            ref_logps=ours["ref_logps"],
        )
        loss.backward()
        total += float(loss.detach())
        stats.append(loss_module.take_stats())
    return total, lora_grads(model), stats


@pytest.mark.parametrize("old", [True, False], ids=["off-policy", "on-policy"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_a_step_equals_trls(loss_type, importance_sampling, beta, old, start, rollout):
    """TRL's `_compute_loss` itself, called on a stand-in trainer for each of two micro-batches; ours on
    the same completions packed into one row per micro-batch and padded one per row: the summed loss
    and every LoRA gradient within 1e-6, and each micro-batch's metrics within 1e-6 of what TRL logged."""
    batches, _ = rollout
    trl_model = copy.deepcopy(start)
    fake = trl_self(trl_model, loss_type, importance_sampling, beta)
    trl_total = 0.0
    for trl_inputs, _, _ in batches:
        inputs = {k: v for k, v in trl_inputs.items() if old or k != "old_per_token_logps"}
        loss = trl.GRPOTrainer._compute_loss(fake, trl_model, inputs)
        loss.backward()
        trl_total += float(loss.detach())
    expected = lora_grads(trl_model)
    logged = fake._metrics["train"]
    names = {*TRL_METRICS, *(["kl"] if beta else [])}
    assert names <= logged.keys()

    cfg = config(loss_type, importance_sampling, beta)
    for packed in (True, False):
        total, grads, stats = our_step(start, rollout, cfg, packed, None, old)
        case = f"packed={packed}"
        assert difference(total, trl_total) <= 1e-6, case
        assert_same_grads(grads, expected, case)
        for m, micro_batch in enumerate(stats):
            assert micro_batch.keys() == names, case
            for name, (value, count) in micro_batch.items():
                assert difference(value / count, logged[name][m]) <= 1e-6, f"{case}: {name} of micro-batch {m}"
    if old:  # the perturbed old policy puts ratios outside the clip region: the clipped branch is exercised
        assert any(sum(logged[f"clip_ratio/{side}_mean"]) > 0 for side in ("low", "high"))


@pytest.mark.parametrize("loss_type,importance_sampling", [("grpo", "sequence"), ("dapo", "token")])
def test_packed_rows_equal_padded_rows_and_chunks_equal_the_full_logits(loss_type, importance_sampling, start, rollout):
    """Every layout and head route gives the padded full-logits numbers: the loss, the LoRA gradients
    and the metrics (the entropy among them) within 1e-6."""
    cfg = config(loss_type, importance_sampling, beta=0.04)
    total, grads, stats = our_step(start, rollout, cfg, packed=False, chunk_size=0, old=True)
    for packed, chunk in itertools.product((True, False), (0, 3, None)):
        if (packed, chunk) == (False, 0):
            continue
        case = f"packed={packed} chunk={chunk}"
        got_total, got_grads, got_stats = our_step(start, rollout, cfg, packed, chunk, old=True)
        assert difference(got_total, total) <= 1e-6, case
        assert_same_grads(got_grads, grads, case)
        for got, expected in zip(got_stats, stats):
            assert got.keys() == expected.keys()
            for name, (value, count) in got.items():
                assert count == expected[name][1] and difference(value, expected[name][0]) <= 1e-6, f"{case}: {name}"


@pytest.mark.parametrize("chunk", [None, 0])
def test_scoring_records_the_policys_and_the_references_log_probabilities(chunk, start, rollout):
    """`recorded`: forward returns a zero without a graph and appends the per-token log-probabilities in
    label order, the policy's (as TRL's own computation gives them) or, with `record_reference`, those
    of the model with its adapter disabled; the adapter is back on afterwards."""
    batches, _ = rollout
    model = copy.deepcopy(start)
    loss_module = GRPOLoss(model, chunk, config())
    for reference in (False, True):
        loss_module.recorded, loss_module.record_reference = [], reference
        for trl_inputs, samples, ours in batches:
            inputs = our_inputs(samples, packed=True)
            out = loss_module(**inputs, advantages=ours["advantages"], num_items_in_batch=torch.tensor(6.0))
            assert float(out) == 0.0 and not out.requires_grad
            recorded = loss_module.recorded[-1]
            assert recorded.dtype == torch.float32 and recorded.device.type == "cpu" and not recorded.requires_grad
            if reference:
                loss_mask = (trl_inputs["completion_mask"] * trl_inputs["tool_mask"]).bool()
                with torch.no_grad(), model.disable_adapter():
                    base, _, _ = trl_logps_and_entropies(
                        model,
                        torch.cat([trl_inputs["prompt_ids"], trl_inputs["completion_ids"]], 1),
                        torch.cat([trl_inputs["prompt_mask"], trl_inputs["completion_mask"]], 1),
                        trl_inputs["completion_ids"].shape[1],
                    )
                assert difference(recorded, base[loss_mask]) <= 1e-6
                assert difference(recorded, ours["current"]) > 1e-3  # the adapter does change them
            else:
                assert difference(recorded, ours["current"]) <= 1e-6
        assert len(loss_module.recorded) == len(batches)
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():  # the adapter is on again
        inputs = our_inputs(batches[0][1], packed=True)
        logps, _ = loss_module.token_logps(inputs["input_ids"], inputs["labels"], position_ids=inputs["position_ids"])
    assert difference(logps, batches[0][2]["current"]) <= 1e-6


def test_unknown_settings_and_missing_inputs_are_refused(start, rollout):
    with pytest.raises(ValueError, match="loss_type"):
        GRPOLoss(start, None, config(loss_type="cispo"))
    with pytest.raises(ValueError, match="importance_sampling"):
        GRPOLoss(start, None, config(importance_sampling="batch"))
    _, samples, ours = rollout[0][0]
    inputs = dict(our_inputs(samples, packed=True), advantages=ours["advantages"], num_items_in_batch=torch.tensor(6.0))
    with pytest.raises(ValueError, match="ref_logps"):
        GRPOLoss(start, None, config(beta=0.04))(**inputs)
    with pytest.raises(ValueError, match="tokens_in_step"):
        GRPOLoss(start, None, config(loss_type="dapo"))(**inputs)
