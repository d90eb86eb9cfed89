"""Multi-turn rollouts (lora_tune/training/episodes.py) against TRL 1.16's own code on the same
sampled tokens: the prompt with its tools, the parsing of each turn (transformers' response parser
with TRL's response template), the tool-result suffix, and the whole tool-call loop (completion
tokens, tool_mask, the completions as messages, call and failure counts) driven by one scripted
sampler on both sides; and the tool calls themselves (errors, timeouts, truncation, bad results)."""

from __future__ import annotations

import copy
import json
import time
import types

import pytest
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from lora_tune.models.tiny.model import build_tiny_llama
from lora_tune.training.episodes import Agent
from lora_tune.training.generation.registry import Sampled, cut_at_eos
from lora_tune.training.tools import Episode, ToolError, call_tool

from helpers import ROOT

trl = pytest.importorskip("trl")
trl_templates = pytest.importorskip("trl.chat_template_utils")

MAX_NEW = 200


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: the expression
    """
    return str(eval(expression, {}))  # test-only: the scripted expressions are fixed


def shout(text: str) -> str:
    """Shouts.

    Args:
        text: what to shout
    """
    return text.upper()


TOOLS = [calculator, shout]
SCHEMAS = [get_json_schema(f) for f in TOOLS]


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call><|im_end|>'


# What the sampler writes for each completion, turn by turn.
SCRIPT = [
    [call("calculator", expression="2 + 3"), "The answer is 5.<|im_end|>"],
    ["Hello there.<|im_end|>"],
    [
        call("calculator", expression="6 * 7").removesuffix("<|im_end|>") + "\n" + call("nope"),  # two calls, one to no tool
        call("calculator", expression="1 / 0"),  # raises; its result would reach the context (512): dropped, the episode ends
    ],
    [call("calculator", expression="10 ** 300")],  # the result (cut to 256 tokens) would pass --max-new-tokens: dropped
    [call("calculator", expression="1 + 1"), "two " * 200],  # the last turn cut to what --max-new-tokens leaves
    ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}\n</tool_call><|im_end|>'],  # malformed: plain text
    [  # --max-tool-calls 3: the fourth call is left as written
        call("calculator", expression="2 ** 2"),
        call("calculator", expression="3 ** 2"),
        call("calculator", expression="4 ** 2"),
        call("calculator", expression="5 ** 2"),
    ],
]
PROMPTS = [[{"role": "user", "content": f"Question {k}?"}] for k in range(len(SCRIPT))]


class Scripted:
    """Each row's next scripted turn, the same whoever asks: TRL's _generate_single_turn or a Generator."""

    def __init__(self, tokenizer, prompts: list[list[int]]):
        self.tok, self.prompts, self.turns = tokenizer, prompts, [0] * len(prompts)

    def row(self, ids: list[int]) -> int:
        return next(k for k, p in enumerate(self.prompts) if ids[: len(p)] == p)

    def next_ids(self, ids: list[int]) -> list[int]:
        k = self.row(ids)
        text = SCRIPT[k][self.turns[k]]
        self.turns[k] += 1
        return self.tok(text, add_special_tokens=False)["input_ids"]

    # ours
    samples_off_policy = False

    def generate(self, index, prompts, seeds):
        return [cut_at_eos(self.next_ids(p), {self.tok.eos_token_id}) for p in prompts]

    # TRL's
    def trl_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [self.next_ids(p) for p in prompt_ids], None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_llama(tmp_path_factory.mktemp("tool-llama"), tools=True))


def config(**overrides):
    base = dict(
        system_message="auto", max_tool_calls=3, max_tool_result_tokens=256, max_seq_len=1024, max_new_tokens=MAX_NEW, tool_timeout=5
    )
    return types.SimpleNamespace(**{**base, **overrides})


def trl_trainer(tokenizer, scripted):
    """What TRL's _tool_call_loop reads of its trainer, with TRL's response template on its tokenizer."""
    tok = trl_templates.add_response_schema(copy.deepcopy(tokenizer))
    fake = types.SimpleNamespace(
        _tokenizer=tok,
        processing_class=tok,
        chat_template=None,
        chat_template_kwargs={},
        _is_vlm=False,
        use_vllm=False,
        vllm_mode="colocate",
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=512)),
        max_completion_length=MAX_NEW,
        max_tool_calling_iterations=3,
        environment_factories=None,
        tools=TOOLS,
        _sync_tool_dicts=[{f.__name__: f for f in TOOLS} for _ in SCRIPT],
        _async_tool_dicts=[{} for _ in SCRIPT],
        _generate_single_turn=getattr(scripted, "trl_turn", None),
    )
    fake._get_tool_suffix_ids = types.MethodType(trl.GRPOTrainer._get_tool_suffix_ids, fake)
    return fake, tok


def test_prompts_and_turns_are_read_as_trl_reads_them(tokenizer):
    """The prompt rendered with the tools is TRL's apply_chat_template(tools=...); each turn of the
    script (and edge cases: text around calls, an open last call, a call without a name, reasoning)
    parses to what transformers' parser makes of it with TRL's response template."""
    agent = Agent(config(), tokenizer, None, {tokenizer.eos_token_id}, 512)
    _, tok = trl_trainer(tokenizer, None)
    schemas = SCHEMAS
    episode = Episode(None, {f.__name__: f for f in TOOLS}, schemas)
    _, ids = agent.prompt({"prompt": PROMPTS[0]}, episode, "row 1")
    assert ids == tokenizer.apply_chat_template(PROMPTS[0], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    texts = [t for turns in SCRIPT for t in turns] + [
        "before\n" + call("shout", text="a").removesuffix("<|im_end|>") + " after<|im_end|>",
        '<tool_call>{"name":"x","arguments":{"q":1}}',
        '<tool_call>{"nam":"x","arguments":{}}</tool_call><|im_end|>',
        '<tool_call>{"name":"x","arguments":null}</tool_call>',
        "<think>hmm</think>ok<|im_end|>",
        "  hello  <|im_end|>",
    ]
    for text in texts:
        turn = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert agent.parse(turn, ids, schemas) == trl_templates.parse_response(tok, turn, prefix=ids, tools=TOOLS), text


def test_the_tool_call_loop_equals_trls(tokenizer):
    """TRL's _tool_call_loop and ours on the same scripted samples: the completion tokens (turns and
    tool-result suffixes), the tool_mask, the completions as messages, and the call/failure counts,
    through a raising tool, an unknown one, two calls in a turn, an overlong result, a truncated last
    turn, a malformed call and --max-tool-calls."""
    agent = Agent(config(), tokenizer, None, {tokenizer.eos_token_id}, 512)
    episodes = [Episode(None, {f.__name__: f for f in TOOLS}, SCHEMAS) for _ in SCRIPT]
    prompt_ids = [agent.prompt({"prompt": p}, e, "row")[1] for p, e in zip(PROMPTS, episodes)]
    ours = agent.run(Scripted(tokenizer, prompt_ids), 0, prompt_ids, list(range(len(SCRIPT))), episodes)

    scripted = Scripted(tokenizer, prompt_ids)
    fake, tok = trl_trainer(tokenizer, scripted)
    first, _ = scripted.trl_turn(prompt_ids, None, {}, 1)
    first = [cut_at_eos(ids, {tokenizer.eos_token_id}).ids for ids in first]  # TRL's generation ends at EOS too
    completions = [[trl_templates.parse_response(tok, ids, prefix=p, tools=TOOLS)] for ids, p in zip(first, prompt_ids)]
    mask, completions, completion_ids, _, calls, failures, _ = trl.GRPOTrainer._tool_call_loop(
        fake, copy.deepcopy(PROMPTS), prompt_ids, first, completions, None, None, {}
    )
    assert [r.ids for r in ours] == completion_ids
    assert [r.mask for r in ours] == mask
    assert [r.turns for r in ours] == completions
    assert [len(r.turns) for r in ours] == [3, 1, 4, 1, 3, 1, 7]
    assert sum(r.episode.counts["calls"] for r in ours) == calls == 9  # dropped (overlong) results' calls count too, as TRL's
    assert sum(r.episode.counts["failures"] for r in ours) == failures == 2  # the unknown tool and 1 / 0
    assert [r.clipped for r in ours] == [ids[-1] != tokenizer.eos_token_id for ids in completion_ids]
    assert 0 in mask[0] and mask[1] == [1] * len(mask[1]) and len(completion_ids[4]) == MAX_NEW  # masks, and the cut


def test_results_are_cut_to_the_limit_and_counted(tokenizer):
    agent = Agent(config(max_tool_result_tokens=5), tokenizer, None, {tokenizer.eos_token_id}, 512)
    episode = Episode(None, {}, [])
    message = agent.result_message("shout", "word " * 50, episode)
    assert len(tokenizer(message["content"], add_special_tokens=False)["input_ids"]) == 5
    assert episode.counts["truncated"] == 1 and message == {"role": "tool", "name": "shout", "content": message["content"]}
    agent = Agent(config(), tokenizer, None, {tokenizer.eos_token_id}, 512)
    assert agent.result_message("shout", {"a": 1}, episode)["content"] == "{'a': 1}" and episode.counts["truncated"] == 1  # TRL's str()


def test_a_tool_that_raises_hangs_or_returns_no_json():
    def hang(seconds: float) -> str:
        time.sleep(seconds)
        return "late"

    def broken(x: int) -> str:
        raise RuntimeError(f"bad {x}")

    def odd() -> set:
        return {1, 2}

    functions = {"hang": hang, "broken": broken, "odd": odd}

    def one(name, **arguments):
        return call_tool(functions, {"type": "function", "function": {"name": name, "arguments": arguments}}, timeout=0.3)

    assert one("broken", x=3) == ("broken", {"error": "bad 3"}, True)
    started = time.monotonic()
    name, result, failed = one("hang", seconds=30)
    assert failed and "did not return within 0.3 s" in result["error"] and time.monotonic() - started < 5
    assert one("hang", seconds=0) == ("hang", "late", False)
    assert one("missing") == ("missing", {"error": "Tool missing not found."}, True)
    assert one("broken", y=1)[2]  # arguments it doesn't take: TRL's TypeError, returned to the model
    with pytest.raises(ToolError, match="tool odd returned a set, which isn't JSON-serialisable"):
        one("odd")


def test_the_examples_calculator_and_game():
    import importlib.util  # noqa: PLC0415 - the examples are files, not modules

    def load(name):
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    assert load("tools").calculator("37 * 12 + 4") == "448"
    game = load("environments").GuessingGame()
    assert game.reset(secret=7, high=10, prompt=[]) == " The number is between 1 and 10."
    assert [game.guess(3), game.guess(9), game.guess(7)] == ["higher", "lower", "correct"] and game.get_reward() == pytest.approx(1 / 3)


def test_sampled_is_cut_at_eos_like_trl():
    assert cut_at_eos([5, 2, 7], {2}) == Sampled([5, 2], False)
