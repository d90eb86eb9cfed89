"""`lora-tune eval`: lm-evaluation-harness on a local task (offline), adapter through peft, base beside
it, results in eval_results.json, the report's PNG and the API; the in-memory hook for --eval-tasks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import lora_tune
from lora_tune.after.evaluation import flat_metrics, run_tasks, task_manager
from lora_tune.cli import main

from helpers import ALPACA, fast_train_args, read_metrics, run_cli, single_error_line, write_jsonl

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is an optional extra (lora-tune[eval])")

# Which of two completions is right: the adapter is trained on the right ones (ALPACA's outputs).
ROWS = [
    {"question": f"Add {a} and {a + 1}.", "choices": [f"The answer is {2 * a + 1}.", f"The answer is {2 * a + 7}."], "answer": 0}
    for a in range(12)
]


def write_task(folder: Path) -> Path:
    """A local multiple-choice task: a YAML beside its JSONL data (absolute path: no working-dir dependence)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "add.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "tiny_add.yaml").write_text(
        "task: tiny_add\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return folder


@pytest.fixture(scope="module")
def run_and_tasks(tiny_model, tmp_path_factory):

    root = tmp_path_factory.mktemp("eval")
    data = write_jsonl(root / "alpaca.jsonl", ALPACA)
    assert main([str(a) for a in fast_train_args(tiny_model, data, root / "run", max_steps=8, lr=2e-2)]) == 0
    return root / "run", write_task(root / "tasks")


def reference_accuracy(model_dir: Path, adapter: Path | None, limit: int) -> float:
    """The task scored by hand: the completion with the higher summed log-likelihood, as lm-eval's acc."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    right = 0
    for row in ROWS[:limit]:
        scores = []
        for choice in row["choices"]:
            context = tokenizer(row["question"])["input_ids"]
            whole = tokenizer(row["question"] + " " + choice)["input_ids"]
            with torch.no_grad():
                logprobs = model(input_ids=torch.tensor([whole])).logits[0, :-1].log_softmax(-1)
            scores.append(sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context), len(whole))))
        right += int(max(range(2), key=lambda i: scores[i]) == row["answer"])
    return right / limit


def test_eval_local_task_base_and_adapter_side_by_side(run_and_tasks, tiny_model, capsys):
    run, tasks = run_and_tasks
    code, out, err = run_cli(["eval", run, "--tasks", "tiny_add", "--include", tasks, "--limit", "10", "--base-too"], capsys)
    assert code == 0, err
    record = json.loads((run / "eval_results.json").read_text())
    assert record["tasks"] == ["tiny_add"] and record["limit"] == 10
    adapter_acc, base_acc = record["adapter"]["tiny_add"]["acc"], record["base"]["tiny_add"]["acc"]
    assert adapter_acc == pytest.approx(reference_accuracy(tiny_model, run, 10))
    assert base_acc == pytest.approx(reference_accuracy(tiny_model, None, 10))
    assert record["seconds"]["adapter"] > 0 and record["seconds"]["base"] > 0
    line = next(line for line in out.splitlines() if line.startswith("tiny_add") and " acc " in line)
    assert f"{base_acc:.4f}" in line and f"{adapter_acc:.4f}" in line and f"{adapter_acc - base_acc:+.4f}" in line
    # lora-tune report puts the scores in its PNG and summary.
    code, out, _ = run_cli(["report", run], capsys)
    assert code == 0 and "tiny_add" in out and (run / "report.png").is_file()


def test_api_evaluate_equals_the_cli_on_a_merged_folder(run_and_tasks, tmp_path, capsys):
    run, tasks = run_and_tasks
    merged = lora_tune.merge(adapter=str(run), output=str(tmp_path / "merged"), dtype="fp32")
    record = lora_tune.evaluate(source=str(merged), tasks="tiny_add", include=str(tasks), limit=10)
    adapter = json.loads((run / "eval_results.json").read_text())["adapter"] if (run / "eval_results.json").is_file() else None
    assert (merged / "eval_results.json").is_file() and "model" in record
    if adapter is not None:  # merged == base + adapter, so the same answers
        assert record["model"]["tiny_add"]["acc"] == adapter["tiny_add"]["acc"]


def test_run_tasks_scores_an_in_memory_model(run_and_tasks, tiny_model):
    """The hook --eval-tasks uses during training: the PeftModel being trained, no files."""

    run, tasks = run_and_tasks
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), run).eval()
    scores = run_tasks(model, AutoTokenizer.from_pretrained(run), ["tiny_add"], limit=10, include=str(tasks))
    assert scores["tiny_add"]["acc"] == pytest.approx(reference_accuracy(tiny_model, run, 10))
    assert flat_metrics(scores)["eval_tasks/tiny_add/acc"] == scores["tiny_add"]["acc"]


def test_eval_bad_input_is_one_line_before_loading(run_and_tasks, tmp_path, capsys):
    run, tasks = run_and_tasks
    cases = [
        (["eval", run, "--tasks", "tiny_ad", "--include", tasks], "did you mean tiny_add"),
        (["eval", run, "--tasks", "tiny_add", "--include", tmp_path / "none"], "--include"),
        (["eval", tmp_path / "nope", "--tasks", "tiny_add"], "does not exist"),
        (["eval", run, "--tasks", "tiny_add", "--limit", "0"], "--limit"),
        (["eval", run, "--tasks", ","], "at least one task"),
    ]
    for argv, expected in cases:
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and expected in single_error_line(err), (argv, err)


def test_eval_tasks_during_training_are_logged_like_eval_loss(run_and_tasks, tiny_model, tmp_path, capsys):
    _, tasks = run_and_tasks
    data = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    out = tmp_path / "run"
    args = fast_train_args(
        tiny_model, data, out, max_steps=2, eval_steps=1, eval_tasks=["tiny_add"], eval_tasks_limit=4, eval_tasks_include=tasks
    )
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    scored = [r for r in read_metrics(out) if "eval_tasks/tiny_add/acc" in r]
    assert [r["step"] for r in scored] == [1, 2] and all(0.0 <= r["eval_tasks/tiny_add/acc"] <= 1.0 for r in scored)
    line = next(line for line in err.splitlines() if "eval tasks at step 2: " in line)
    assert f"tiny_add/acc {scored[-1]['eval_tasks/tiny_add/acc']:.4f}" in line


def test_eval_tasks_are_checked_before_loading(run_and_tasks, tiny_model, tmp_path, capsys):
    _, tasks = run_and_tasks
    data = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    code, _, err = run_cli(fast_train_args(tiny_model, data, tmp_path / "a", eval_tasks=["tiny_ad"], eval_tasks_include=tasks), capsys)
    assert code == 2 and "tiny_ad" in single_error_line(err) and not (tmp_path / "a").exists()
    code, _, err = run_cli(fast_train_args(tiny_model, data, tmp_path / "b", eval_tasks=["tiny_add"], zero=2), capsys)
    assert code == 2 and "--eval-tasks scores the model in one process" in single_error_line(err)


def test_eval_outside_a_git_repository_prints_no_git_error(run_and_tasks, tmp_path, capfd, monkeypatch):
    """lm-eval runs `git describe` with our stderr: outside a repository every eval (and every
    --eval-tasks evaluation) printed "fatal: not a git repository". --verbose leaves it be."""
    run, tasks = run_and_tasks
    monkeypatch.chdir(tmp_path)  # not a repository (the suite runs inside one)
    for verbose, expected in ((False, False), (True, True)):
        argv = ["eval", run, "--tasks", "tiny_add", "--include", tasks, "--limit", "2", "--output", tmp_path / "r.json"]
        assert main([str(a) for a in argv] + (["--verbose"] if verbose else [])) == 0
        assert ("fatal: not a git repository" in capfd.readouterr().err) == expected


def test_eval_of_a_damaged_adapter_config_is_one_line(run_and_tasks, tmp_path, capsys):
    run, tasks = run_and_tasks
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    (broken / "adapter_config.json").write_bytes(b"\xff\xfe{garbage")
    code, _, err = run_cli(["eval", broken, "--tasks", "tiny_add", "--include", tasks], capsys)
    assert code == 2 and f"eval: {broken} is unreadable or truncated (Expecting value" in single_error_line(err)


def test_eval_of_a_base_model_folder_asks_for_an_output(run_and_tasks, tiny_model, tmp_path, capsys):
    """Its default, SOURCE/eval_results.json, would write into a model lora-tune did not write."""
    _, tasks = run_and_tasks
    before = sorted(p.name for p in tiny_model.iterdir())
    code, _, err = run_cli(["eval", tiny_model, "--tasks", "tiny_add", "--include", tasks, "--limit", "2"], capsys)
    assert code == 2 and "eval writes nothing into it; pass --output FILE.json" in single_error_line(err)
    assert sorted(p.name for p in tiny_model.iterdir()) == before
    code, out, err = run_cli(
        ["eval", tiny_model, "--tasks", "tiny_add", "--include", tasks, "--limit", "2", "--output", tmp_path / "b.json"], capsys
    )
    assert code == 0 and json.loads((tmp_path / "b.json").read_text())["limit"] == 2, err


def test_lm_evals_registry_is_built_once_per_state_of_the_include_folder(tmp_path):
    """Tasks all defined under --include are looked up in that folder alone (lm-eval's own ~14,700 task
    files take seconds to index); each registry is built once per process, and again when a task file
    under --include changes: a renamed task is never looked up in a stale one. A
    task --include doesn't define is looked up in lm-eval's whole registry."""
    tasks = write_task(tmp_path / "tasks")
    local = task_manager(str(tasks), ["tiny_add"])
    assert task_manager(str(tasks), ["tiny_add"]) is local and local.all_tasks == ["tiny_add"]
    renamed = (tasks / "tiny_add.yaml").read_text().replace("task: tiny_add", "task: tiny_sum")
    (tasks / "tiny_add.yaml").write_text(renamed)
    edited = task_manager(str(tasks), ["tiny_sum"])
    assert edited is not local and edited.all_tasks == ["tiny_sum"]
    whole = task_manager(str(tasks), ["tiny_sum", "arc_easy"])
    assert {"tiny_sum", "arc_easy"} <= set(whole.all_tasks) and len(whole.all_tasks) > 1000
