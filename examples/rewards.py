"""Reward functions for `lora-tune train --objective grpo`, with TRL's signature: the prompts, the
completions (strings; for chat prompts, lists of one assistant message) and every other column of
the data as keyword lists; one float per completion (None: not scored by this function).

    lora-tune train --objective grpo --data examples/data/grpo_demo.jsonl --reward examples/rewards.py:correct \
        --reward examples/rewards.py:formatted --reward-weights 1 0.2 ...
"""

import re


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(prompts, completions, answer, **kwargs):
    """1 when the last number in the completion is the row's `answer`, else 0."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+", _text(completion))
        scores.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return scores


def formatted(prompts, completions, **kwargs):
    """1 for an answer written as 'Answer: N', else 0."""
    return [1.0 if re.search(r"Answer:\s*-?\d+", _text(c)) else 0.0 for c in completions]


def digits(prompts, completions, **kwargs):
    """The share of characters that are digits: a dense toy signal that even a tiny random model can learn (the demo's)."""
    return [sum(ch.isdigit() for ch in _text(c)) / max(len(_text(c)), 1) for c in completions]


def grounded(prompts, completions, **kwargs):
    """Agentic runs (--tools): 1 when the final answer repeats the last number a tool returned, else 0
    (completions are lists of turns: assistant messages and the tool results between them)."""
    scores = []
    for turns in completions:
        results = [t["content"] for t in turns if isinstance(turns, list) and t["role"] == "tool"]
        scores.append(1.0 if results and results[-1] in _text(turns) else 0.0)
    return scores


def tool_ok(prompts, completions, **kwargs):
    """Agentic runs (--tools): 1 when the completion called a tool and every call returned a result
    (no error), else 0: a dense signal for well-formed calls."""
    scores = []
    for turns in completions:
        results = [t["content"] for t in turns if isinstance(turns, list) and t["role"] == "tool"]
        scores.append(1.0 if results and not any(r.startswith("{'error'") for r in results) else 0.0)
    return scores
