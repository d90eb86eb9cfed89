"""Preference objectives (lora_tune/training/objectives/preference.py): the same numbers as TRL's trainers on the same
pairs, packed or padded, chunked or full logits; and through the CLI and the API: ln 2 at a
zero-initialised start, a rule learned, the reference precomputed or per step, --init-adapter."""

from __future__ import annotations

import copy
import math

import datasets
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import lora_tune
from lora_tune.data.batching import collate
from lora_tune.data.prepare import prepare_data
from lora_tune.training.objectives.preference import PreferenceLoss
from lora_tune.training.objectives.reference import REFERENCE_FILE

from helpers import FAST, adapted_tiny_model, data_config, fast_train_args, read_metrics, run_cli, step_losses, write_jsonl

trl = pytest.importorskip("trl")

# Answers of different lengths, so padding, packing and length normalisation all matter.
PAIRS = [
    {"prompt": "Pick a fruit 0:", "chosen": " apple is good", "rejected": " kiwi kiwi kiwi bad"},
    {"prompt": "Pick a fruit 1:", "chosen": " peach", "rejected": " plum is not ripe yet"},
    {"prompt": "Name a colour please:", "chosen": " red", "rejected": " blue"},
    {"prompt": "Q:", "chosen": " the quick brown fox", "rejected": " the lazy dog"},
]
KTO_ROWS = [
    {"prompt": "Pick a fruit 0:", "completion": " apple is good", "label": True},
    {"prompt": "Pick a fruit 1:", "completion": " plum is not ripe yet", "label": False},
    {"prompt": "Name a colour please:", "completion": " red", "label": True},
    {"prompt": "Q:", "completion": " the lazy dog", "label": False},
]
BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1, "kto": 0.1}


@pytest.fixture(scope="module")
def start(tiny_model):
    """The tiny model with an adapter whose B is not zero (so it changes the model), its tokenizer."""
    return adapted_tiny_model(tiny_model), AutoTokenizer.from_pretrained(tiny_model)


def trl_trainer(objective: str, model, tokenizer, rows: list[dict], out):
    """TRL's trainer of the objective, at its settings equal to ours (one micro-batch of 4 units)."""
    common = dict(output_dir=str(out), per_device_train_batch_size=4, report_to="none", use_cpu=True, beta=BETA[objective])
    dataset = datasets.Dataset.from_list(rows)
    if objective in ("dpo", "ipo"):
        args = trl.DPOConfig(**common, loss_type=["sigmoid" if objective == "dpo" else "ipo"], max_length=None)
        return trl.DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    if objective == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: PLC0415 - experimental, only this case

        args = CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5, remove_unused_columns=False)
        return CPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    if objective == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: PLC0415 - experimental, only this case

        args = ORPOConfig(**common, remove_unused_columns=False)
        return ORPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    args = trl.KTOConfig(**common, train_sampling_strategy="sequential")
    return trl.KTOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


def trl_sequences(objective: str, batch: dict) -> list[list[int]]:
    """The token ids TRL scores, in our order: each unit's two sequences one after the other."""

    def rows(ids, mask):
        return [r[m.bool()].tolist() for r, m in zip(ids, mask)]

    if objective in ("dpo", "ipo"):
        both = rows(batch["input_ids"], batch["attention_mask"])
        half = len(both) // 2
        firsts, seconds = both[:half], both[half:]
    elif objective == "kto":
        firsts = rows(batch["input_ids"], batch["attention_mask"])
        seconds = rows(batch["KL_input_ids"], batch["KL_attention_mask"])
    else:
        firsts = rows(batch["chosen_input_ids"], batch["chosen_attention_mask"])
        seconds = rows(batch["rejected_input_ids"], batch["rejected_attention_mask"])
    return [seq for pair in zip(firsts, seconds) for seq in pair]


def perturbed(model, noise: dict):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in noise:
                p.add_(noise[name])
    return model


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_first_step_loss_and_lora_gradients_equal_trls(objective, start, tmp_path):
    """The same rows, the same adapter at the start, then the same update of it (so the policy is not
    the reference): our loss and every LoRA gradient equal TRL's within 1e-5 relative, packed and
    padded, with the head in chunks or as full logits. TRL's reference for a PEFT model with an
    adapter is a frozen copy of that adapter: ours is the same starting model (--init-adapter),
    scored in the precomputing pass."""
    peft_start, tokenizer = start
    rows = KTO_ROWS if objective == "kto" else PAIRS
    trl_model = copy.deepcopy(peft_start)
    trainer = trl_trainer(objective, trl_model, tokenizer, rows, tmp_path / "trl")  # copies the adapter as its reference
    generator = torch.Generator().manual_seed(1)
    noise = {n: 0.05 * torch.randn(p.shape, generator=generator) for n, p in peft_start.named_parameters() if p.requires_grad}
    perturbed(trl_model, noise).train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trl_loss = trainer.compute_loss(trl_model, batch)
    trl_loss.backward()
    expected = lora_grads(trl_model)

    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = data_config(data, objective=objective, init_adapter=str(tmp_path), simpo_gamma=0.5, **{"beta": BETA[objective]})
    samples = list(prepare_data(cfg, tokenizer).train)
    ours_sequences = [s.input_ids[a:b] for s in samples for a, b in zip(s.starts, [*s.starts[1:], len(s.input_ids)])]
    assert ours_sequences == trl_sequences(objective, batch), "the same tokens are scored"

    recorder = PreferenceLoss(copy.deepcopy(peft_start).eval(), None, objective, cfg)
    recorder.recorded = []
    with torch.no_grad():
        recorder(**collate([samples], tokenizer.pad_token_id, True, units=True).inputs, num_items_in_batch=torch.tensor(4.0))
    reference = recorder.recorded[0]  # the starting adapter's log-probabilities (unused by simpo and orpo)

    logps = {}
    for packed in (True, False):
        for chunk in (16, 0):
            model = perturbed(copy.deepcopy(peft_start), noise).train()
            loss_module = PreferenceLoss(model, chunk, objective, cfg)
            mb = collate([samples] if packed else [[s] for s in samples], tokenizer.pad_token_id, packed, units=True)
            mb.set_step_totals(mb.counts)
            loss = loss_module(**mb.inputs, reference_logps=reference, num_items_in_batch=torch.tensor(float(mb.counts["units"])))
            loss.backward()
            case = f"packed={packed} chunk={chunk}"
            assert float(loss) == pytest.approx(float(trl_loss), rel=1e-5), case
            for name, grad in lora_grads(model).items():
                assert (grad - expected[name]).abs().max() <= 1e-5 * expected[name].abs().max(), f"{case}: {name}"
            with torch.no_grad():
                logps[packed, chunk] = loss_module.sequence_logps(
                    **{k: mb.inputs.get(k) for k in ("input_ids", "labels", "sequence_ids", "attention_mask", "position_ids")},
                    n_sequences=mb.inputs["sequence_label_tokens"].numel(),
                )
            stats = loss_module.take_stats()
            assert {"rewards/chosen", "rewards/rejected"} <= stats.keys()
    # Packed rows (block-diagonal attention from position_ids) score each sequence as padded rows do.
    for key, value in logps.items():
        torch.testing.assert_close(value, logps[False, 0], rtol=1e-6, atol=1e-5, msg=str(key))


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", PAIRS * 4)


def dpo_args(base, data, out, **overrides):
    return fast_train_args(base, data, out, **{"objective": "dpo", "max_steps": 2, "max_seq_len": 64, **overrides})


def test_a_zero_initialised_adapter_starts_at_ln2_exactly(tiny_model, pairs_file, tmp_path, capsys):
    """Policy == reference at the start: every pair's margin is 0 and its loss -log sigmoid(0)."""
    code, _, err = run_cli(dpo_args(tiny_model, pairs_file, tmp_path / "run"), capsys)
    assert code == 0, err
    first = read_metrics(tmp_path / "run")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert (first["rewards/margins"], first["rewards/chosen"], first["rewards/accuracies"]) == (0.0, 0.0, 0.0)
    assert first["logps/chosen"] > first["logps/rejected"]  # the rejected answers are the longer ones here
    assert "reference for dpo: a forward with the adapter disabled in every step" in err


@pytest.mark.parametrize("objective", ["ipo", "orpo", "simpo", "kto"])
def test_every_objective_trains_from_the_cli(objective, tiny_model, pairs_file, tmp_path, capsys):
    data = pairs_file if objective != "kto" else write_jsonl(tmp_path / "kto.jsonl", KTO_ROWS * 4)
    code, _, err = run_cli(dpo_args(tiny_model, data, tmp_path / "run", objective=objective, eval_split=0.25, eval_steps=2), capsys)
    assert code == 0, err
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    evals = [r for r in read_metrics(tmp_path / "run") if "eval_loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    assert {"rewards/chosen", "rewards/rejected"} <= steps[0].keys() and "eval_rewards/chosen" in evals[0]
    assert "eval_ppl" not in evals[0]
    own = {"orpo": "log_odds_ratio", "kto": "kl", "ipo": "rewards/margins", "simpo": "rewards/margins"}[objective]
    assert own in steps[0]
    if objective in ("orpo", "simpo"):
        assert f"reference for {objective}" not in err  # reference-free


WORDS = ["python", "code", "poem", "story", "summary", "answer"]  # one token each in the tiny tokenizer


def test_a_rule_is_learned_and_followed(tiny_model, tmp_path):
    """Pairs whose chosen answer repeats the word of the prompt: the held-out reward accuracy ends at 1,
    and greedy generations, which before training follow the rule for no word, follow it for each."""
    rng = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(96):
        word, other = (WORDS[int(i)] for i in torch.randperm(len(WORDS), generator=rng)[:2])
        rows.append({"prompt": f"Say {word}:", "chosen": f" {word}", "rejected": f" {other}"})
    data = write_jsonl(tmp_path / "rule.jsonl", rows)
    options = {**FAST, "rank": 8, "max_steps": None, "epochs": 20, "micro_batch_size": 8, "max_seq_len": 32}
    result = lora_tune.train(
        base=str(tiny_model),
        data=str(data),
        output_dir=str(tmp_path / "run"),
        objective="dpo",
        beta=0.5,
        eval_split=0.25,
        eval_steps=30,
        **options,
    )
    steps = [r for r in result.metrics if "loss" in r]
    evals = [r for r in result.metrics if "eval_rewards/accuracies" in r]
    assert steps[0]["rewards/accuracies"] == 0.0  # no margin yet
    assert evals[-1]["eval_rewards/accuracies"] == 1.0 and evals[-1]["eval_rewards/margins"] > 1.0

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)

    def followed(model) -> int:
        hits = 0
        for word in WORDS:
            ids = tokenizer(f"Say {word}:", return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            hits += tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split()[:1] == [word]
        return hits

    assert followed(base) == 0
    assert followed(PeftModel.from_pretrained(base, result.adapter_dir)) == len(WORDS)


def test_the_reference_precomputed_equals_per_step_and_is_cached(tiny_model, pairs_file, tmp_path, capsys):
    """Both ways of getting the reference train the same numbers; the precomputed one is kept in the
    run (for a resume) and in the data cache, where a second run finds it."""
    runs = {}
    for name, mode in (("per-step", "per-step"), ("precompute", "precompute"), ("cached", "precompute")):
        code, _, err = run_cli(dpo_args(tiny_model, pairs_file, tmp_path / name, max_steps=3, reference=mode), capsys)
        assert code == 0, err
        runs[name] = (step_losses(tmp_path / name), err)
    assert runs["precompute"][0] == pytest.approx(runs["per-step"][0], rel=1e-6)
    assert runs["cached"][0] == runs["precompute"][0]
    assert "reference log-probabilities of 16 + 0 units computed" in runs["precompute"][1]
    assert "reference for dpo: from the cache" in runs["cached"][1] and "computed in" not in runs["cached"][1]
    table = load_file(tmp_path / "precompute" / REFERENCE_FILE)
    assert table["train"].shape == (16, 2) and bool((table["train"] < 0).all())


def test_dpo_from_an_sft_adapter(tiny_model, pairs_file, data_files, tmp_path, capsys):
    """--init-adapter: training starts from the SFT adapter, which is also the reference (first loss ln 2);
    a resume whose reference file is gone refuses rather than guess the starting adapter."""
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], tmp_path / "sft", max_steps=2), capsys)
    assert code == 0, err
    # Without the data cache the run's own copy is the only one of its reference.
    args = dpo_args(tiny_model, pairs_file, tmp_path / "dpo", init_adapter=tmp_path / "sft", max_steps=3, save_steps=2, data_cache=False)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert read_metrics(tmp_path / "dpo")[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert "reference for dpo: one pass over the data before training" in err
    start, end = load_file(tmp_path / "sft" / "adapter_model.safetensors"), load_file(tmp_path / "dpo" / "adapter_model.safetensors")
    assert start.keys() == end.keys() and any(not torch.equal(start[k], end[k]) for k in start)

    (tmp_path / "dpo" / REFERENCE_FILE).unlink()
    code, _, err = run_cli([*args, "--resume", "--max-steps", "4"], capsys)  # extended: a finished run has no step left
    assert code == 2 and "the reference log-probabilities of this run" in err and "are missing" in err, err


def test_plan_counts_both_sequences_of_a_pair(tiny_model, capsys):
    sft = lora_tune.plan(base=str(tiny_model), max_seq_len=256, gradient_checkpointing="on")
    dpo = lora_tune.plan(base=str(tiny_model), max_seq_len=256, gradient_checkpointing="on", objective="dpo")
    assert dpo.estimate.saved_activations_bytes == 2 * sft.estimate.saved_activations_bytes
    assert dpo.setup.tokens == 2 * sft.setup.tokens and dpo.setup.reference
