"""`check-serving --engine vllm --live`: the adapter served by a real vLLM (the session's server on this
CPU) decodes what transformers + peft decode, token for token; where they part, the first divergence
is named and an early one fails the check."""

from __future__ import annotations

import pytest

from lora_tune.after import live_serving
from lora_tune.after.live_serving import Comparison
from lora_tune.cli import main

from helpers import fast_train_args, run_cli, single_error_line, write_jsonl


@pytest.fixture(scope="module")
def trained(vllm_tiny_model, tmp_path_factory):
    """An fp32 rsLoRA adapter on the session server's base, trained enough to change what it decodes."""
    root = tmp_path_factory.mktemp("live")
    data = write_jsonl(root / "text.jsonl", [{"text": f"The quick brown fox number {a} jumps over the lazy dog."} for a in range(12)])
    assert main([str(a) for a in fast_train_args(vllm_tiny_model, data, root / "run", rank=8, rslora=True, lr=5e-2, max_steps=6)]) == 0
    return root / "run"


def test_the_served_adapter_decodes_what_peft_decodes(vllm_server, trained, capsys):
    code, out, err = run_cli(["check-serving", trained, "--engine", "vllm", "--live", "--vllm-url", vllm_server], capsys)
    assert code == 0, err
    assert "vllm live: 4/4 prompts token for token equal to transformers + peft; 78/78 tokens agree" in out  # some end at EOS


def test_an_early_divergence_fails_and_a_late_one_is_named(capsys):
    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    late = [Comparison("a prompt", [1, 2, 3] * 4, [1, 2, 3] * 3 + [1, 2, 4])]
    live_serving.report(late, Tok())
    out, err = capsys.readouterr()
    assert live_serving.agrees(late) and "first divergence at token 11: vLLM '<3>' vs transformers + peft '<4>'" in out and not err
    early = [*late, Comparison("another", [5, 6, 7], [5, 9, 7])]
    live_serving.report(early, Tok())
    out, err = capsys.readouterr()
    assert not live_serving.agrees(early) and "first divergence at token 1: vLLM '<6>'" in out
    assert "differently from transformers + peft within the first 8 tokens" in err
    assert Comparison("ends early", [1, 2], [1, 2, 3]).divergence == 2  # one stopping first is a difference too


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--engine", "llama.cpp", "--live"], "--live serves the adapter on vLLM; it has no llama.cpp check"),
        (["--live", "--vllm-url", "http://127.0.0.1:9"], "no vLLM server answers at http://127.0.0.1:9"),
    ],
)
def test_live_checks_that_can_t_run_are_one_line(extra, words, tiny_model, data_files, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], run, max_steps=1), capsys)[0] == 0
    code, _, err = run_cli(["check-serving", run, *extra], capsys)
    assert code == 2 and words in single_error_line(err)
