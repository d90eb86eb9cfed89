"""--init-lora-weights: every init keeps the base's function at step 0, and an adapter from an init
that changes the base (PiSSA, OLoRA) is written as a plain LoRA of the original base: merged, or
loaded with stock peft on the original base, it computes what training ended with."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from peft import EvaConfig, LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, initialize_lora_eva_weights
from peft.tuners.lora.config import CordaConfig
from peft.tuners.lora.corda import preprocess_corda
from transformers import AutoModelForCausalLM

from lora_tune.cli import main
from lora_tune.config import TrainConfig
from lora_tune.data.batching import collate
from lora_tune.data.prepare import prepare_data
from lora_tune.errors import UserError
from lora_tune.models import data_inits, inits
from lora_tune.models.adapter import add_lora
from lora_tune.models.loading import load_base_model, load_tokenizer

from helpers import ALPACA, adapter_tensors, assert_bit_identical, fast_train_args, read_metrics, run_cli, step_losses, write_jsonl

# eva, corda, lora_ga: from a statistics pass over the run's first micro-batches (lora_tune.models.data_inits).
INITS = ["gaussian", "orthogonal", "pissa", "pissa_niter_4", "olora", "eva", "corda", "lora_ga"]
RUN = dict(max_steps=3, eval_split=0.25, eval_steps=3, lr=2e-2)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Plain LoRA and each init, the same 3 steps on the tiny model (fp32), evaluated at the end."""
    root = tmp_path_factory.mktemp("inits")
    data = write_jsonl(root / "alpaca.jsonl", ALPACA)
    for init in [None, *INITS]:
        extra = {"init_lora_weights": init} if init else {}
        assert main([str(a) for a in fast_train_args(tiny_model, data, root / str(init), **RUN, **extra)]) == 0
    return {"root": root, "data": data}


@pytest.mark.parametrize("init", INITS)
def test_every_init_keeps_the_base_function_at_step_1_and_trains_its_own_way(init, runs):
    plain, own = step_losses(runs["root"] / "None"), step_losses(runs["root"] / init)
    assert own[0] == pytest.approx(plain[0], abs=2e-6)  # PiSSA/OLoRA: W_res + s B0 A0 = W up to fp32 rounding
    assert own[-1] != pytest.approx(plain[-1], abs=1e-3)  # started elsewhere, trained elsewhere


def eval_loss(model, run) -> float:
    """The loss over the run's evaluation samples, as the loop computes it: summed over label tokens."""
    cfg = TrainConfig(**yaml.safe_load((run / "lora_tune_config.yaml").read_text()))
    samples = prepare_data(cfg, load_tokenizer(cfg.base)).eval
    total = count = 0
    with torch.no_grad():
        for i in range(len(samples)):
            ids, labels = torch.tensor([samples[i].input_ids]), torch.tensor([samples[i].labels])
            n = int((labels[:, 1:] != -100).sum())
            total, count = total + float(model(input_ids=ids, labels=labels).loss) * n, count + n
    return total / count


@pytest.mark.parametrize("init", ["pissa", "olora", "orthogonal", "eva", "corda", "lora_ga"])
def test_the_merged_folder_and_peft_on_the_original_base_compute_the_runs_last_eval_loss(init, runs, tiny_model, tmp_path, capsys):
    run = runs["root"] / init
    last = [r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r][-1]
    config = json.loads((run / "adapter_config.json").read_text())
    rank = 8 if inits.changes_base(init) else 4  # PiSSA / OLoRA: [A; A0], [B, -B0]
    assert config["r"] == rank and config["lora_alpha"] == 2 * rank and config["init_lora_weights"] is True
    assert all(t.shape[0 if "lora_A" in k else 1] == rank for k, t in adapter_tensors(run).items())
    code, _, err = run_cli(["merge", "--adapter", run, "--output", tmp_path / "merged", "--dtype", "fp32"], capsys)
    assert code == 0, err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), run).eval()
    assert eval_loss(peft_model, run) == pytest.approx(last, rel=1e-6)
    assert eval_loss(merged, run) == pytest.approx(last, rel=1e-5)
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft_model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_the_conversion_is_peft_own(tiny_model, tmp_path):
    """inits.converted writes what peft's save_pretrained(path_initial_model_for_weight_conversion) writes."""
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights="pissa"),
    )
    initial = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    model.save_pretrained(tmp_path / "initial")  # peft's initial adapter, as its conversion needs it
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "peft", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    state, config = inits.converted(get_peft_model_state_dict(model), initial, model.peft_config["default"])
    assert_bit_identical(state, adapter_tensors(tmp_path / "peft"))
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config.r, config.lora_alpha, config.init_lora_weights) == (written["r"], written["lora_alpha"], written["init_lora_weights"])


@pytest.mark.parametrize("init", ["pissa_niter_2", "corda"])
def test_a_run_with_a_residual_base_resumes_exactly_from_its_converted_checkpoint(init, runs, tiny_model, tmp_path, capsys):
    """The checkpoint holds the converted adapter; the resume recomputes the residual base (CorDA: from the
    same first micro-batches) and reads the trained half back: 4 steps straight = 2 steps, then 2 more."""
    args = dict(max_steps=4, save_steps=2, lr=2e-2, init_lora_weights=init, dropout=0.1, lr_scheduler="constant")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, _, err = run_cli(fast_train_args(tiny_model, runs["data"], straight, **args), capsys)
    assert code == 0, err
    code, _, err = run_cli(fast_train_args(tiny_model, runs["data"], resumed, **{**args, "max_steps": 2}), capsys)
    assert code == 0, err
    code, _, err = run_cli(fast_train_args(tiny_model, runs["data"], resumed, **args, resume=True), capsys)
    assert code == 0 and "resumed from" in err, err
    assert_bit_identical(adapter_tensors(straight), adapter_tensors(resumed))
    assert step_losses(straight) == step_losses(resumed)


def test_a_converted_adapter_from_another_start_is_refused_in_one_line(runs, tiny_model):
    """Resume reads the trained half of [A; A0]; the other half must be this run's A0 on this base."""
    cfg = TrainConfig(**yaml.safe_load((runs["root"] / "pissa" / "lora_tune_config.yaml").read_text()))
    peft_model = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, str(tiny_model))
    path = runs["root"] / "pissa" / "adapter_model.safetensors"
    saved = adapter_tensors(runs["root"] / "pissa")
    own = inits.own_form(saved, peft_model, path)
    assert all(own[k].shape[0 if "lora_A" in k else 1] == 4 for k in own)
    key = next(k for k in saved if "lora_A" in k)
    saved[key] = saved[key].clone()
    saved[key][-1] += 1  # a row of A0 that is not this init's
    with pytest.raises(UserError, match=f"{key} did not start from this run's initial adapter"):
        inits.own_form(saved, peft_model, path)


def first_batches(model_dir, data, count=3) -> list[dict]:
    """A few micro-batches of the tiny data as the recipe hands them to a statistics pass."""
    tokenizer = load_tokenizer(str(model_dir))
    samples = prepare_data(TrainConfig(base=str(model_dir), data=[str(data)], output_dir="unused"), tokenizer).train
    return [collate([[samples[i]], [samples[i + 1]]], tokenizer.pad_token_id, False).inputs for i in range(0, 2 * count, 2)]


@pytest.mark.parametrize("init", ["eva", "corda"])
def test_a_data_init_is_peft_own_on_the_same_batches(init, runs, tiny_model):
    """EVA's A and CorDA's A, B and residual base are what peft's own flow computes over the same
    micro-batches (EVA: get_peft_model + initialize_lora_eva_weights with rho 1; CorDA: preprocess_corda
    + get_peft_model)."""
    batches = first_batches(tiny_model, runs["data"])
    cfg = TrainConfig(base=str(tiny_model), data=[str(runs["data"])], output_dir="unused", rank=4, init_lora_weights=init, dropout=0.0)
    ours = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, str(tiny_model), first_batches=lambda: batches)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = copy.deepcopy(ours.peft_config["default"])
    config.init_lora_weights = init
    if init == "eva":
        config.eva_config = EvaConfig(rho=1.0)
        theirs = get_peft_model(base, config)
        initialize_lora_eva_weights(theirs, dataloader=batches, show_progress_bar=False)
        compared = ["lora_A"]
    else:
        config.corda_config = CordaConfig(corda_method="ipm")

        def run_model():
            for batch in batches:
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
                    base(input_ids=ids[mask.bool()].unsqueeze(0))

        preprocess_corda(base, config, run_model=run_model)
        theirs = get_peft_model(base, config)
        compared = ["lora_A", "lora_B", "base_layer"]
    mine, peft_own = dict(ours.named_parameters()), dict(theirs.named_parameters())
    names = [n for n in peft_own if any(part in n for part in compared) and "proj" in n]
    assert len(names) >= 14
    for name in names:
        torch.testing.assert_close(mine[name], peft_own[name], rtol=1e-5, atol=1e-6, msg=name)
    if init == "eva":  # A moved off the seeded Kaiming draw; B is still 0
        assert all(not p.abs().sum() for n, p in mine.items() if "lora_B" in n)


def test_a_data_init_is_refused_where_no_rank_holds_the_base_or_there_is_no_sequence(runs, tiny_model):
    cfg = TrainConfig(base=str(tiny_model), data=[str(runs["data"])], output_dir="unused", init_lora_weights="eva")
    with pytest.raises(UserError, match="no rank holds a whole one to run"):
        inits.check(cfg, needs_reference=False, partitioned=True)
    with pytest.raises(UserError, match="has prompts, not training sequences"):
        inits.check(cfg, needs_reference=False, online=True)
    inits.check(cfg, needs_reference=True)  # EVA keeps the base: a reference is the base as it was
    with pytest.raises(UserError, match="corda: peft's covariance hooks read one text sequence at a time, and 3 training rows"):
        data_inits.check_data("corda", 3)  # said by preflight once the data is read, before the model loads
    data_inits.check_data("eva", 3)
    data_inits.check_data("corda", 0)
