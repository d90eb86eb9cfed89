"""The Python API mirrors the CLI: same runs, same numbers, same errors; plus report and eval prompts."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch

import lora_tune
from lora_tune.errors import UserError

from helpers import ALPACA, FAST, fast_train_args, run_cli, single_error_line, write_jsonl


def options(**overrides) -> dict:
    """fast_train_args' options as API keywords."""
    return {**FAST, **overrides}


@pytest.fixture(scope="module")
def api_run(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("api")
    data = write_jsonl(folder / "alpaca.jsonl", ALPACA)
    result = lora_tune.train(
        base=str(tiny_model), data=str(data), output_dir=str(folder / "run"), eval_split=0.25, eval_steps=2, **options()
    )
    return result, data, folder


def test_train_returns_the_run_and_equals_the_cli(api_run, tiny_model, capsys):
    result, data, folder = api_run
    assert result.steps == 4 and result.adapter_dir == folder / "run" and (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert (
        result.eval_loss is not None
        and result.final_loss == result.metrics[[i for i, r in enumerate(result.metrics) if "loss" in r][-1]]["loss"]
    )
    code, _, err = run_cli(fast_train_args(tiny_model, data, folder / "cli", eval_split=0.25, eval_steps=2), capsys)
    assert code == 0, err
    cli = [json.loads(line) for line in (folder / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("loss") for r in cli] == [r.get("loss") for r in result.metrics]


@pytest.mark.parametrize(
    "bad", [dict(rank=0), dict(precision="int3"), dict(base="llama-7b"), dict(data="/no/such.jsonl"), dict(nonsense=1)]
)
def test_bad_input_raises_the_cli_message(bad, tiny_model, data_files, tmp_path, capsys):
    kwargs = {"base": str(tiny_model), "data": str(data_files["text"]), "output_dir": str(tmp_path / "out"), **options(), **bad}
    with pytest.raises(lora_tune.UserError) as raised:
        lora_tune.train(**kwargs)
    argv = ["train"]
    for k, v in kwargs.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    try:
        code, _, err = run_cli(argv, capsys)
    except SystemExit as e:  # an unknown flag is argparse's
        code, err = e.code, capsys.readouterr().err
    assert code == 2
    if "nonsense" not in bad:
        assert single_error_line(err) == f"error: {raised.value}"
    assert not (tmp_path / "out").exists()


def test_plan_returns_the_json_numbers(capsys):
    plan = lora_tune.plan(base="llama-8b", precision="4bit", gpu_memory="rtx4090")
    code, out, _ = run_cli([*"plan --base llama-8b --precision 4bit --gpu-memory rtx4090 --json".split()], capsys)
    assert code == 0 and plan.to_json() == json.loads(out) and plan.fits is True and "fits in 23.6 GiB" in plan.text
    auto = lora_tune.plan(base="llama-8b", gpu_memory="rtx4090", auto=True)
    assert auto.recommended["command"].startswith("lora-tune train --base llama-8b")


def test_merge_and_load_generate_the_same_as_the_adapter(api_run):
    result, _, folder = api_run
    merged = lora_tune.merge(adapter=str(result.adapter_dir), output=str(folder / "merged"), dtype="fp32")
    assert (merged / "model.safetensors").is_file() or (merged / "model.safetensors.index.json").is_file()
    outputs = []
    for path in (result.adapter_dir, merged):
        model, tokenizer = lora_tune.load(path, device="cpu", dtype="fp32")
        ids = tokenizer("The quick brown fox", return_tensors="pt")
        with torch.no_grad():
            outputs.append(model.generate(**ids, max_new_tokens=6, do_sample=False)[0].tolist())
    assert outputs[0] == outputs[1]
    with pytest.raises(lora_tune.UserError, match="neither an adapter"):
        lora_tune.load(folder)


def test_report_plots_a_real_run_and_summarises_it(api_run, capsys, monkeypatch):
    result, _, folder = api_run
    png = lora_tune.report(result.output_dir, folder / "report.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "steps: 4; loss" in out and "eval loss: last" in out
    code, out, err = run_cli(["report", result.output_dir, "--output", folder / "cli.png"], capsys)
    assert code == 0 and (folder / "cli.png").is_file() and "plot:" in out
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, _, err = run_cli(["report", result.output_dir, "--output", folder / "x.png"], capsys)
    assert code == 2 and "pip install matplotlib" in single_error_line(err)


def test_eval_prompts_log_greedy_completions_at_each_evaluation(tiny_model, data_files, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"instruction": "Add 2 and 3."}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    out = tmp_path / "run"
    code, _, err = run_cli(
        fast_train_args(tiny_model, data_files["alpaca"], out, eval_prompts=prompts, eval_steps=2, eval_max_new_tokens=5), capsys
    )
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in rows if "samples" in r]
    assert [r["step"] for r in samples] == [2, 4]
    assert samples[0]["samples"][0]["prompt"].endswith("### Instruction:\nAdd 2 and 3.\n\n### Response:\n")
    assert samples[0]["samples"][1]["prompt"].endswith("<|user|>\nhi\n<|assistant|>\n")  # the chat template's generation prompt
    assert "sample at step 2:" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], tmp_path / "bad", eval_prompts=bad), capsys)
    assert code == 2 and "needs a 'prompt', 'instruction' or 'messages' field" in single_error_line(err)


@pytest.mark.parametrize("content", [b"", b"\xff\xfe garbage", b"[1, 2]", b'{"base_model_name_or_path": 3}'])
def test_load_of_a_broken_adapter_config_is_one_user_error(content, tmp_path):
    (tmp_path / "adapter_config.json").write_bytes(content)
    with pytest.raises(UserError, match="adapter_config.json"):
        lora_tune.load(tmp_path)


def test_load_takes_a_checkpoint_with_its_run_s_tokenizer(api_run):
    """`load("RUN/checkpoint-N")` raised transformers' raw ValueError: a checkpoint holds no tokenizer."""
    result, _, _ = api_run
    (checkpoint,) = result.output_dir.glob("checkpoint-*")  # the final step's
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    logits = []
    for path in (result.adapter_dir, checkpoint):
        model, tokenizer = lora_tune.load(path, device="cpu", dtype="fp32")
        assert tokenizer("The quick brown fox")["input_ids"] == [1, 282, 488, 470, 80, 482]
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_after_training_functions_take_source_first_as_the_cli_does(api_run, tmp_path):
    """check_serving(run_dir, ...), export(run_dir, ...), evaluate(run_dir, ...) read their first argument
    as a YAML config ('config file RUN is a folder; pass a YAML file to --config')."""
    result, _, _ = api_run
    report = lora_tune.check_serving(result.output_dir, engine="vllm")
    assert (
        report.command
        == f"vllm serve {json.loads((result.adapter_dir / 'adapter_config.json').read_text())['base_model_name_or_path']} "
        + (f"--enable-lora --lora-modules adapter={result.output_dir}")
    )
    exported = lora_tune.export(result.output_dir, output=str(tmp_path / "run.gguf"), verify=False)
    assert exported.path == tmp_path / "run.gguf" and exported.path.read_bytes()[:4] == b"GGUF"
    with pytest.raises(UserError, match=r"^--tasks: no_such_task is not an lm-eval task"):
        lora_tune.evaluate(result.output_dir, tasks="no_such_task")
    with pytest.raises(UserError, match=r"first argument is SOURCE .* a config goes in config="):
        lora_tune.export("export.yaml", output=str(tmp_path / "x.gguf"))


@pytest.mark.parametrize(
    "call,expected",
    [
        (lambda run: lora_tune.train(rnak=8), r"lora_tune.train\(\): unknown option 'rnak' \(did you mean rank\?\)"),
        (lambda run: lora_tune.export(run, outptu="x.gguf"), r"lora_tune.export\(\): unknown option 'outptu' \(did you mean output\?\)"),
        (lambda run: lora_tune.merge(adapter=run, outpt="m"), r"lora_tune.merge\(\): unknown option 'outpt' \(did you mean output\?\)"),
    ],
)
def test_an_unknown_keyword_gets_a_did_you_mean(call, expected, api_run):
    with pytest.raises(UserError, match=expected):
        call(str(api_run[0].output_dir))


def test_a_stopped_api_run_names_the_call_to_continue_it(tiny_model, data_files, tmp_path):
    """TrainingStopped said "same command plus --resume" inside Python: it names the call instead, which
    continues the run; the stopped folder loads from its checkpoint meanwhile."""

    def stop_after_step_1(record):
        if record.get("step") == 1:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C in a notebook does: the step ends, a checkpoint is saved

    kwargs = dict(base=str(tiny_model), data=str(data_files["alpaca"]), output_dir=str(tmp_path / "run"), **options())
    with pytest.raises(lora_tune.errors.TrainingStopped) as stopped:
        lora_tune.train(**kwargs, callback=stop_after_step_1)
    assert str(stopped.value).endswith("Continue with the same lora_tune.train(...) call with resume=True")
    assert stopped.value.exit_code == 130 and not (tmp_path / "run" / "adapter_config.json").exists()
    model, _ = lora_tune.load(tmp_path / "run", device="cpu", dtype="fp32")  # checkpoint-1
    assert model.peft_config["default"].r == 4
    assert lora_tune.train(**kwargs, resume=True).steps == 4
    # Run once more (a notebook cell run again): the run is finished, its result as it is, nothing written.
    adapter = (tmp_path / "run" / "adapter_model.safetensors").read_bytes()
    assert lora_tune.train(**kwargs, resume=True).steps == 4
    assert (tmp_path / "run" / "adapter_model.safetensors").read_bytes() == adapter
