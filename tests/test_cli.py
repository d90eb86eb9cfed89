"""The command line: flags and YAML keys are one schema, --help documents every option, and every bad
input ends in one `error:` line naming the culprit, exit code 2, no traceback, before the model is
loaded, with nothing written to disk."""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import lora_tune.engines.registry
from lora_tune.cli import build_parser, config_from_args, main, quiet_libraries, without_flags
from lora_tune.config import TrainConfig
from lora_tune.errors import UserError
from lora_tune.models.aliases import architecture
from lora_tune.options import flag
from lora_tune.planner.architecture import Architecture

from helpers import fast_train_args, run_cli, run_cli_subprocess, single_error_line, write_jsonl


def parse(argv):
    return config_from_args(TrainConfig, build_parser().parse_args(argv))


def test_flags_override_yaml(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("base: tiny-llama\ndata: d.jsonl\noutput_dir: out\nrank: 8\nlr: 0.001\ntarget_modules: [q_proj, v_proj]\n")
    cfg = parse(["train", "--config", str(cfg_file), "--rank", "32", "--no-gradient-checkpointing"])
    assert cfg.rank == 32 and cfg.lr == 0.001 and cfg.gradient_checkpointing == "off"
    assert cfg.target_modules == ["q_proj", "v_proj"]
    assert cfg.lora_alpha == 64  # default alpha follows the overridden rank


def test_unknown_yaml_key_suggests_the_right_one(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("base: tiny-llama\ndata: d.jsonl\noutput_dir: out\nlearning_rat: 0.1\nmax_seq_length: 10\n")
    with pytest.raises(UserError, match=r"unknown key 'learning_rat'"):
        parse(["train", "--config", str(cfg_file)])
    cfg_file.write_text("base: tiny-llama\ndata: d.jsonl\noutput_dir: out\nmax_seq_length: 10\n")
    with pytest.raises(UserError, match=r"did you mean max_seq_len\?"):
        parse(["train", "--config", str(cfg_file)])


def test_help_documents_every_option_and_the_registered_backends(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for name, field in TrainConfig.model_fields.items():
        assert flag(name) in text, name
        assert field.description, f"{name} has no help text"
    assert "--backend single|ddp|deepspeed|fsdp" in text and "--zero 0|1|2|3" in text
    for name, description in lora_tune.engines.registry.names().items():
        assert f"{name}: {description.split()[0]}" in " ".join(text.split())


def test_help_with_a_config_shows_the_file_s_values_as_the_defaults(tmp_path, capsys, monkeypatch):
    """`train --config X --help` showed the built-in defaults (rank 16), not what the run would use."""
    monkeypatch.chdir(tmp_path)  # a short file name: --help wraps long ones at their dashes
    (tmp_path / "c.yaml").write_text("rank: 32\nlr: 0.0005\n")
    with pytest.raises(SystemExit) as done:
        main(["train", "--config", "c.yaml", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0
    assert "--rank RANK LoRA rank r. (default: 32, from c.yaml)" in text and "Peak learning rate. (default: 0.0005, from c.yaml)" in text
    assert "Default: 2 x rank. (default: unset)" in text  # --alpha: what the file leaves out keeps its built-in default
    assert main(["train", "--config", "none.yaml", "--help"]) == 2
    assert single_error_line(capsys.readouterr().err).startswith("error: config file none.yaml does not exist")


def test_version_and_help_load_no_library_and_print_no_noise():
    version = run_cli_subprocess(["--version"])
    assert version.returncode == 0 and version.stdout.strip().startswith("lora-tune ") and version.stderr == ""
    helped = run_cli_subprocess(["train", "--help"])
    assert helped.returncode == 0 and helped.stderr == "", helped.stderr  # no bitsandbytes / transformers chatter


def test_peft_s_notes_on_its_own_fused_expert_patterns_are_quiet():
    """`lora-tune models` (and plan, train) on Qwen3-Next printed peft's RuntimeWarning about the
    rank_pattern it adds itself for fused experts; --verbose shows it again."""
    config = architecture("qwen3-next-80b-a3b")
    for quiet, expected in ((True, []), (False, ["The following rank_pattern keys did not match any targeted module"])):
        with warnings.catch_warnings(record=True) as seen:
            quiet_libraries(quiet)
            Architecture.from_config({**config, "_name_or_path": f"quiet {quiet}"})  # a config of its own: not the cached skeleton
        said = [
            str(w.message).split(" and were")[0]
            for w in seen
            if issubclass(w.category, RuntimeWarning) and "rank_pattern" in str(w.message)
        ]
        assert said == expected
    quiet_libraries()


def test_without_flags_drops_flags_and_their_values():
    argv = ["train", "--nproc", "2", "--local_rank=1", "--rank", "8", "--nproc=3"]
    assert without_flags(argv, "--nproc", "--local_rank") == ["train", "--rank", "8"]


@dataclass
class Case:
    """What a bad-input case may use: the tiny model, a good data file, a scratch folder."""

    model: Path
    good: Path
    tmp: Path

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    def file(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def binary(self, name: str, data: bytes = bytes(range(256)) * 8) -> Path:
        path = self.tmp / name
        path.write_bytes(data)
        return path

    def model_with(self, name: str, change) -> Path:
        """A copy of the tiny model (in tmp/base) with one file's bytes changed."""
        base = self.tmp / "base"
        if not base.exists():
            shutil.copytree(self.model, base)
        (base / name).write_bytes(change((base / name).read_bytes()))
        return base

    def folder(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir()
        return path

    def train(self, data=None, **options) -> list:
        return fast_train_args(self.model, self.good if data is None else data, self.out, **options)

    @property
    def pairs(self) -> Path:
        return write_jsonl(self.tmp / "pairs.jsonl", [{"prompt": "Q", "chosen": " yes", "rejected": " no"}])

    def adapter(self, rank: int) -> Path:
        """An adapter folder as the tiny model's runs write it (rank, alpha 2 x rank, every linear layer)."""
        modules = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        self.file("sft/adapter_config.json", json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": modules}))
        return self.file("sft/adapter_model.safetensors", "").parent


# (arguments, expected fragment of the one error line): each built from a Case.
BAD_INPUT = {
    "missing data": (lambda c: c.train(c.tmp / "nope.jsonl", max_steps=1), "nope.jsonl does not exist"),
    "folder without data files": (
        lambda c: c.train(c.file("notes/readme.txt", "no data here").parent, max_steps=1),
        "holds no .jsonl/.json/.parquet/.csv files",
    ),
    "unsupported extension": (lambda c: c.train(c.file("data.txt", "hello"), max_steps=1), "unsupported extension"),
    "broken json line": (
        lambda c: c.train(c.file("broken.jsonl", '{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n'), max_steps=1),
        "line 3 is not valid JSON",
    ),
    "unknown columns": (
        lambda c: c.train(write_jsonl(c.tmp / "qa.jsonl", [{"question": "q", "answer": "a"}]), max_steps=1),
        "instruction + output (alpaca)",
    ),
    "empty dataset": (lambda c: c.train(c.file("empty.jsonl", ""), max_steps=1), "empty"),
    "malformed messages": (
        lambda c: c.train(
            write_jsonl(c.tmp / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}]),
            max_steps=1,
        ),
        "role 'bot'",
    ),
    "messages without assistant": (
        lambda c: c.train(write_jsonl(c.tmp / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]), max_steps=1),
        "no assistant message",
    ),
    "rank 0": (lambda c: c.train(rank=0), "--rank: must be a positive integer (got 0); typical values are 8, 16, 32, 64"),
    "negative rank": (lambda c: c.train(rank=-4), "--rank: must be a positive integer (got -4)"),
    "unknown precision": (lambda c: c.train(precision="int3"), "--precision: got 'int3'"),
    "lr 0": (lambda c: c.train(lr=0), "--lr: must be > 0 (got 0"),
    "max-seq-len 0": (lambda c: c.train(max_seq_len=0), "--max-seq-len: must be a positive integer (got 0)"),
    "unknown alias": (lambda c: fast_train_args("llama-7b", c.good, c.out), "unknown model alias 'llama-7b'"),
    "missing base dir": (lambda c: fast_train_args(c.tmp / "no-model", c.good, c.out), "no-model does not exist"),
    "unknown config key": (
        lambda c: ["train", "--config", c.file("c.yaml", "rnk: 8\n"), "--base", c.model, "--data", c.good, "--output-dir", c.out],
        "unknown key 'rnk' in",
    ),
    "rank not a number": (lambda c: c.train(rank="abc"), "argument --rank: invalid int value: 'abc'"),
    "missing output dir": (lambda c: ["train", "--base", c.model, "--data", c.good], "--output-dir is required"),
    "eval split out of range": (lambda c: c.train(eval_split=1.5), "--eval-split: must be in [0, 1) (got 1.5)"),
    "zero max steps": (lambda c: c.train(max_steps=0), "--max-steps: must be a positive integer (got 0); leave it out to disable"),
    "zero micro batch": (lambda c: c.train(micro_batch_size=0), "--micro-batch-size: must be a positive integer"),
    "negative weight decay": (lambda c: c.train(weight_decay=-1), "--weight-decay: must be >= 0 (got -1"),
    "unknown init": (
        lambda c: c.train(init_lora_weights="pisa"),
        "--init-lora-weights: unknown init 'pisa'; choose from gaussian, orthogonal, pissa, pissa_niter_N, olora, eva, corda",
    ),
    "loftq init": (lambda c: c.train(init_lora_weights="loftq"), "--init-lora-weights: loftq is refused: peft's LoftQ quantizes"),
    "eva under zero-3": (lambda c: c.train(init_lora_weights="eva", zero=3), "no rank holds a whole one to run: use --zero 2"),
    "lora-ga under fsdp": (
        lambda c: c.train(init_lora_weights="lora-ga", backend="fsdp"),
        "--init-lora-weights lora-ga runs the base over the run's first micro-batches before the adapter goes in; this backend",
    ),
    "init batches without a data init": (
        lambda c: c.train(init_batches=4, init_lora_weights="pissa"),
        "--init-batches sizes the statistics pass of --init-lora-weights eva, corda or lora-ga; leave it out with "
        "--init-lora-weights pissa",
    ),
    "corda on 4bit": (lambda c: c.train(init_lora_weights="corda", precision="4bit"), "(QPiSSA), which lora-tune doesn't do yet"),
    "pissa on 4bit": (lambda c: c.train(init_lora_weights="pissa", precision="4bit"), "(QPiSSA), which lora-tune doesn't do yet"),
    "pissa with dora": (lambda c: c.train(init_lora_weights="pissa", dora=True), "DoRA's magnitudes are norms of the residual"),
    "pissa with a reference": (
        lambda c: c.train(c.pairs, init_lora_weights="pissa", objective="dpo"),
        "the reference policy (the base without the adapter) would be that residual",
    ),
    "orthogonal on 4bit": (
        lambda c: c.train(init_lora_weights="orthogonal", precision="4bit"),
        "--init-lora-weights orthogonal: peft's orthogonal init casts A and B to the base weight's storage dtype",
    ),
    "orthogonal odd rank": (lambda c: c.train(init_lora_weights="orthogonal", rank=3), "pass an even --rank, not 3"),
    "rank pattern without =R": (
        lambda c: c.train(rank_pattern=["down_proj"]),
        "--rank-pattern: 'down_proj' has no =R; write REGEX=R, e.g. down_proj=32",
    ),
    "rank pattern not a rank": (lambda c: c.train(rank_pattern=["q_proj=big"]), "--rank-pattern: 'q_proj=big': 'big' is not a positive"),
    "alpha pattern bad regex": (lambda c: c.train(alpha_pattern=["q_proj(=8"]), "--alpha-pattern: 'q_proj(' is not a regular expression"),
    "negative layer": (lambda c: c.train(layers_to_transform=["-1"]), "--layers-to-transform: give decoder layer indices from 0"),
    "token the tokenizer lacks": (
        lambda c: c.train(trainable_tokens=["<|brand_new|>"]),
        "--trainable-tokens: '<|brand_new|>' is not a token of this tokenizer (it splits into",
    ),
    "unknown module to save": (
        lambda c: c.train(modules_to_save=["score_head"]),
        "--modules-to-save: score_head is not a module of this model; name one such as lm_head",
    ),
    "unknown peft type": (lambda c: c.train(peft_type="fourier"), "--peft-type: got 'fourier'"),
    "adalora under deepspeed": (
        lambda c: c.train(peft_type="adalora", zero=2),
        "--peft-type adalora: its step (the rank allocator, peft's update_and_allocate) reads every adapter gradient whole",
    ),
    "adalora option with lora": (
        lambda c: c.train(adalora_tinit=1),
        "--adalora-tinit is an option of --peft-type adalora, not of lora: leave it out (or change the type)",
    ),
    "adalora target above rank": (
        lambda c: c.train(peft_type="adalora", adalora_target_r=8),
        "--adalora-target-r 8 is above --rank 4: AdaLoRA only lowers ranks",
    ),
    "adalora schedule longer than the run": (
        lambda c: c.train(peft_type="adalora", adalora_tinit=3, adalora_tfinal=1),
        "--adalora-tinit 3 + --adalora-tfinal 1 leave none of this run's 4 steps for AdaLoRA to reallocate ranks in",
    ),
    "lora-only option with another type": (
        lambda c: c.train(peft_type="oft", dora=True),
        "--dora is a LoRA option; --peft-type oft has no such thing: leave it out (or use --peft-type lora)",
    ),
    "loraplus with another type": (lambda c: c.train(peft_type="loha", loraplus_lr_ratio=16), "--loraplus-lr-ratio is a LoRA option"),
    "type without bitsandbytes layers": (
        lambda c: c.train(peft_type="loha", precision="4bit"),
        "--peft-type loha: peft has no bitsandbytes layers for loha, so it can't adapt a 4bit base",
    ),
    "type with step hooks under fsdp": (
        lambda c: c.train(peft_type="adalora", backend="fsdp"),
        "--peft-type adalora: its step (the rank allocator, peft's update_and_allocate) reads every adapter gradient whole",
    ),
    "type under zero-3": (
        lambda c: c.train(peft_type="loha", zero=3),
        "--peft-type loha: peft sizes a loha adapter from each base weight's shape, and ZeRO-3 has partitioned the base",
    ),
    "loraplus ratio 0": (
        lambda c: c.train(loraplus_lr_ratio=0),
        "--loraplus-lr-ratio: must be > 0 (got 0.0); the LoRA+ paper uses 16; leave it out for plain LoRA",
    ),
    "unknown scheduler": (lambda c: c.train(lr_scheduler="cosine_restarts"), "--lr-scheduler: got 'cosine_restarts'"),
    "unknown optimizer": (lambda c: c.train(optim="lion"), "--optim: got 'lion'"),
    "unknown backend": (lambda c: c.train(backend="horovod"), "--backend: got 'horovod'; choose one of single, ddp, deepspeed, fsdp"),
    "unknown zero stage": (lambda c: c.train(zero=4), "--zero: got 4; choose one of 0, 1, 2, 3"),
    "reporter not installed": (lambda c: c.train(report_to="wandb"), "pip install wandb"),
    "invalid yaml": (
        lambda c: [
            "train",
            "--config",
            c.file("bad.yaml", "rank: [8\nlr: 1\n"),
            "--base",
            c.model,
            "--data",
            c.good,
            "--output-dir",
            c.out,
        ],
        "not valid YAML",
    ),
    "binary config file": (
        lambda c: ["train", "--config", c.binary("bin.yaml"), "--base", c.model, "--data", c.good, "--output-dir", c.out],
        "bin.yaml is not text (not UTF-8)",
    ),
    "config file is a folder": (
        lambda c: ["train", "--config", c.folder("configs"), "--base", c.model, "--data", c.good, "--output-dir", c.out],
        "configs is a folder; pass a YAML file",
    ),
    "output dir under a file": (
        lambda c: fast_train_args(c.model, c.good, c.file("a-file", "x") / "run"),
        "would be inside",
    ),
    "truncated base weights": (
        lambda c: fast_train_args(c.model_with("model.safetensors", lambda b: b[: len(b) // 2]), c.good, c.out),
        "model.safetensors is truncated",
    ),
    "garbage base weights": (
        lambda c: fast_train_args(c.model_with("model.safetensors", lambda b: bytes(255 - x for x in b)), c.good, c.out),
        "model.safetensors is not a readable safetensors file",
    ),
    "output dir is the base": (
        lambda c: fast_train_args(c.model_with("config.json", bytes), c.good, c.tmp / "base"),
        "is the base model's folder",
    ),
    "binary eval prompts": (lambda c: c.train(eval_prompts=c.binary("p.txt")), "--eval-prompts: "),
    "eval prompt row not an object": (
        lambda c: c.train(eval_prompts=c.file("p.jsonl", '{"prompt": "hi"}\n["hi"]\n')),
        "line 2 is a JSON list",
    ),
    "missing config file": (
        lambda c: ["train", "--config", c.tmp / "none.yaml", "--base", c.model, "--data", c.good, "--output-dir", c.out],
        "none.yaml does not exist",
    ),
    "output dir is a file": (lambda c: fast_train_args(c.model, c.good, c.file("a-file", "x")), "is a file"),
    "hub dataset unreachable": (
        lambda c: c.train("someone/no-such-dataset"),
        "the dataset someone/no-such-dataset is not in the local Hugging Face cache",
    ),
    "base folder without config": (lambda c: fast_train_args(c.folder("not-a-model"), c.good, c.out), "has no config.json"),
    "bad column mapping": (lambda c: c.train(data_columns="instruction"), "--data-columns: 'instruction' is not NAME=COLUMN"),
    "mapped column missing": (lambda c: c.train(data_columns="text=body"), "has no column 'body' to map"),
    "weights do not match sources": (lambda c: c.train(data_weights=["1", "2"]), "--data-weights: 2 weights for 1 sources"),
    "sharegpt unknown speaker": (
        lambda c: c.train(
            write_jsonl(
                c.tmp / "sg.jsonl",
                [
                    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                    {"conversations": [{"from": "narrator", "value": "x"}]},
                ],
            ),
            max_steps=1,
        ),
        "sg.jsonl: row 2: conversations[0] is from 'narrator'",
    ),
    "pretokenized ids out of vocabulary": (
        lambda c: c.train(write_jsonl(c.tmp / "ids.jsonl", [{"input_ids": [1, 5, 70000]}]), max_steps=1),
        "token id 70000 is outside the tokenizer's vocabulary",
    ),
    "pretokenized labels out of vocabulary": (
        lambda c: c.train(
            write_jsonl(c.tmp / "ids.jsonl", [{"input_ids": [1, 5, 6, 7]}, {"input_ids": [1, 5, 6, 7], "labels": [-100, 5, 70000, 7]}]),
            max_steps=1,
        ),
        "ids.jsonl: row 2: label 70000 is neither a token id of the tokenizer's vocabulary",
    ),
    "flash attention on cpu": (
        lambda c: c.train(attn_implementation="flash_attention_2"),
        "--attn-implementation flash_attention_2 needs a CUDA GPU",
    ),
    "activation offload without checkpointing": (
        lambda c: c.train(activation_offload=True, gradient_checkpointing=False),
        "--activation-offload moves the inputs that gradient checkpointing keeps",
    ),
    "hub model not reachable": (
        lambda c: fast_train_args("someone/no-such-model", c.good, c.out),
        "the model someone/no-such-model is not in the local Hugging Face cache",
    ),
    "offload on one device": (lambda c: c.train(offload="cpu"), "--offload needs a sharding backend"),
    "an adapter vLLM can't serve": (lambda c: c.train(dora=True, serve_with="vllm"), "--serve-with vllm: "),
    "preference pairs with the sft objective": (lambda c: c.train(c.pairs), "--objective sft trains on text, alpaca, chat"),
    "sft data with a preference objective": (
        lambda c: c.train(objective="dpo"),
        "--objective dpo trains on preference pairs: prompt + chosen + rejected; --data",
    ),
    "unknown objective": (
        lambda c: c.train(c.pairs, objective="ppo"),
        "--objective: got 'ppo'; input should be 'sft', 'dpo', 'ipo', 'orpo', 'simpo', 'kto' or 'grpo'",
    ),
    "an option of another objective": (
        lambda c: c.train(c.pairs, objective="dpo", orpo_lambda=0.5),
        "--orpo-lambda applies to --objective orpo",
    ),
    "beta with orpo": (lambda c: c.train(c.pairs, objective="orpo", beta=0.5), "ORPO's weight is --orpo-lambda"),
    "train on prompt with preferences": (
        lambda c: c.train(c.pairs, objective="dpo", train_on_prompt=True),
        "--train-on-prompt trains next",
    ),
    "a kto label that is not a bool": (
        lambda c: c.train(write_jsonl(c.tmp / "kto.jsonl", [{"prompt": "Q", "completion": "A", "label": "good"}]), objective="kto"),
        "kto.jsonl: row 1: 'label' must be true (desirable) or false (undesirable), got 'good'",
    ),
    "init adapter not an adapter": (
        lambda c: c.train(c.pairs, objective="dpo", init_adapter=c.folder("empty")),
        "is not an adapter folder",
    ),
    "init adapter of another rank": (
        lambda c: c.train(c.pairs, objective="dpo", init_adapter=c.adapter(rank=8)),
        "has r 8 (this run: 4); lora_alpha 16 (this run: 8); pass the options it was trained with (e.g. --rank 8 --alpha 16)",
    ),
    "per-step reference with an init adapter": (
        lambda c: c.train(c.pairs, objective="dpo", init_adapter=c.adapter(rank=4), reference="per-step"),
        "--reference per-step disables the adapter",
    ),
    "compile with a 4-bit base": (
        lambda c: c.train(precision="4bit", compile=True),
        "--compile: bitsandbytes' 4bit layers don't compile (Inductor can't trace their kernels); use --precision bf16",
    ),
    "compile under zero-3": (lambda c: c.train(zero=3, compile=True), "--compile: ZeRO-3 gathers its sharded weights from hooks inside"),
    "evaluation steps with nothing to evaluate": (
        lambda c: c.train(eval_steps=2),
        "--eval-steps 2: there is nothing to evaluate (no --eval-data, --eval-split, --eval-prompts or --eval-tasks)",
    ),
    "several processes on one device": (
        lambda c: c.train(nproc=2, backend="single"),
        "several processes need a backend that coordinates them: use --backend ddp or --zero 1 or --backend fsdp (or leave --backend out)",
    ),
}
if not torch.cuda.is_available():
    BAD_INPUT["activation offload on cpu"] = (lambda c: c.train(activation_offload=True), "--activation-offload needs a CUDA GPU")


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("no engine may start (and load the model) for bad input")

    monkeypatch.setattr(lora_tune.engines.registry, "create", refuse)


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_is_one_clear_error(name, tmp_path, tiny_model, data_files, capsys, no_model_loading):
    if name == "reporter not installed" and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    build, expected = BAD_INPUT[name]
    argv = build(Case(tiny_model, data_files["text"], tmp_path))
    before = sorted(tmp_path.rglob("*"))
    try:
        code, _, err = run_cli(argv, capsys)
    except SystemExit as e:  # argparse-level errors exit from inside the parser
        code, err = e.code, capsys.readouterr().err
    assert code == 2, err
    assert expected in single_error_line(err)
    assert sorted(tmp_path.rglob("*")) == before, "a refused command must not write anything"
