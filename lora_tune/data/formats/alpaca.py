"""Alpaca: `instruction`, `input` (optional), `output`, rendered with the Stanford prompt; the loss
is on the output."""

from lora_tune.data.formats.fields import string

NAME = "alpaca"
COLUMNS = ("instruction", "output")

WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def claims(columns: set) -> bool:
    return True


def pieces(record: dict, where: str, chat) -> list[tuple[str, bool]]:
    extra = record.get("input") or ""
    template = WITH_INPUT if str(extra).strip() else NO_INPUT
    prompt = template.format(instruction=string(record, "instruction", where), input=extra)
    return [(prompt, False), (string(record, "output", where), True)]
