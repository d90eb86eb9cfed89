"""Online RL's batches (GRPO): the policy completes the data's prompts, the reward functions score
the completions, and the scored completions become the micro-batches the loss trains on.

One generation batch serves `--num-iterations` optimizer steps: it holds the prompts of one step
(micro-batch x grad-accum completions per rank, `--num-generations` per prompt), taken from a
seeded shuffle of the prompts per epoch. On N ranks each takes a contiguous share of the batch's
prompts, so every group stays whole on one rank; the rewards (with the completions' lengths) are
gathered, so advantages and statistics are the whole batch's on every rank. A completion's tokens
depend on its place in the whole batch, not on the rank: N ranks generate, score and train on what
one process would. The policy is the base with its adapter (never merged); it
generates with a KV cache over left-padded prompts, and a completion ends at its first EOS
(everything after it is masked); one that reaches `--max-new-tokens` without EOS is clipped.

Sampling is reproducible by construction: each completion draws its tokens from a generator
seeded by (seed, generation batch, prompt, completion), through the exponential race (argmax of
p / E with E ~ Exp(1) picks token i with probability p_i), so a completion does not depend on
which other completions share its batch, and a resumed run generates the same completions.

Advantages are TRL's (lora_tune.training.rewards.advantages). A group whose rewards all tie has
advantage 0 for every completion: with no KL term (beta 0) its loss and gradient are exactly 0, so
its completions are not run through the model at all (the step's normalisers still count them, so
the loss equals TRL's); bnpo, whose normaliser is each micro-batch's own tokens, keeps them.

A rank trains exactly --grad-accum micro-batches per step (the backends count micro-steps, and
sharded ones gather weights in every forward): the completions it runs are split evenly between
them. The micro-batches pack each one's completions into one row (positions restart per completion, no
attention mask: the same logits as padded rows, tested), or pad one completion per row without
packing. Old log-probabilities (`--num-iterations` > 1) and the reference's (beta > 0: the adapter
disabled, no second copy of the base) are scored once per generation batch in no-grad passes.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lora_tune.data.batching import MicroBatch, collate, permutation
from lora_tune.data.prepare import Sample
from lora_tune.engines import ranks as dist
from lora_tune.errors import UserError
from lora_tune.files import write_safetensors
from lora_tune.models.head import IGNORE
from lora_tune.training.episodes import Agent
from lora_tune.training.generation.registry import Generator, special_ids
from lora_tune.training.objectives.grpo import sampling_correction
from lora_tune.training.rewards import RewardError, advantages, unscorable
from lora_tune.training.tools import Episode

log = logging.getLogger("lora_tune")

ROLLOUT_FILE = "rollout-rank{rank}.safetensors"  # a checkpoint's generation batch (this rank's share), when steps of it remain
SAMPLES_FILE = "completions.jsonl"
SAMPLES_LOGGED = 4  # prompt / completion / reward samples written per logging step
GRPO_INPUTS = ("input_ids", "labels", "sequence_ids", "attention_mask", "position_ids")  # what collate builds that the loss takes


def steps_per_epoch(cfg, n_prompts: int) -> int:
    """Optimizer steps of one pass over the prompts: a generation batch per step's prompts, each
    trained `--num-iterations` times."""
    prompts_per_step = cfg.micro_batch_size * cfg.grad_accum * world_size(cfg) // cfg.num_generations
    return math.ceil(n_prompts / prompts_per_step) * cfg.num_iterations


def world_size(cfg) -> int:
    """The ranks of this run: the process group's, or --nproc's before the launcher starts them."""
    return max(dist.world_size(), cfg.nproc or 1)


def check_reward_columns(rewards, prompts) -> None:
    """Every column a reward function asks for by name (`answer`) is in the data, before loading."""
    present = set(prompts.row(0)) - {"prompt"} if len(prompts) else set()
    for name, wanted in rewards.columns().items():
        missing = [c for c in wanted if c not in present]
        if missing:
            raise UserError(
                f"--reward {name} takes the data column {missing[0]!r}, which --data lacks (its columns: {', '.join(sorted(present))}); "
                "add it, rename a column with --data-columns, or give the parameter a default"
            )


@dataclass
class Completion:
    prompt_index: int
    prompt_ids: list[int]
    ids: list[int]  # up to and including its first EOS (with tools: every turn, and the tool results between them)
    clipped: bool  # reached --max-new-tokens without EOS
    sampling_logps: list[float] | None = None  # the sampler's, when it is not the trainer (vLLM)
    mask: list[int] | None = None  # with tools: 1 where the model generated the token (trained), 0 where tools and the template wrote it
    prompt_turns: list[dict] | None = None  # with tools: the prompt as the episode began (reset's text appended)
    turns: list[dict] | None = None  # with tools: the completion as TRL's messages (assistant turns, tool results)
    episode: Episode | None = None  # with tools: its environment and tool calls

    @property
    def generated(self) -> list[int]:
        """1 for each token the model generated: what trains and what the length metrics count."""
        return self.mask if self.mask is not None else [1] * len(self.ids)


class Rollout:
    """The generation batches of a run, and the micro-batches built from them."""

    def __init__(self, inputs, model, engine, rewards, generator: Generator):
        self.inputs, self.cfg, self.model, self.engine, self.rewards = inputs, inputs.cfg, model, engine, rewards
        self.generator = generator
        # vLLM samples with other numerics than the trainer's: TRL's importance-sampling correction
        self.corrects = generator.samples_off_policy and self.cfg.vllm_importance_sampling_correction
        self.prompts = inputs.data.train
        self.per_rank = self.cfg.micro_batch_size * self.cfg.grad_accum // self.cfg.num_generations  # prompts per rank
        self.per_generation = self.per_rank * dist.world_size()
        self.pad_id, self.eos_ids = special_ids(inputs.tokenizer, model)
        context = model.get_base_model().config.get_text_config(decoder=True).max_position_embeddings
        self.agent = Agent(self.cfg, inputs.tokenizer, inputs.toolbox, self.eos_ids, context) if inputs.toolbox else None
        self.current: tuple[int, list[MicroBatch]] | None = None  # (generation batch, its micro-batches)
        self.warned_unscored = False
        self.samples: list[dict] = []  # what the next logging step writes to completions.jsonl

    # --- the micro-batches of a step -------------------------------------------------------------------
    def step_batches(self, step: int) -> list[MicroBatch]:
        index = step // self.cfg.num_iterations
        if self.current is None or self.current[0] != index:
            self.current = (index, self._generation_batch(index, step))
        return self.current[1]

    def _prompt_indices(self, index: int) -> list[int]:
        n = len(self.prompts)
        picks = []
        for k in range(index * self.per_generation, (index + 1) * self.per_generation):
            epoch, position = divmod(k, n)
            picks.append(permutation(n, self.cfg.seed, epoch)[position])
        return picks

    def _generation_batch(self, index: int, step: int) -> list[MicroBatch]:
        cfg = self.cfg
        first = dist.rank() * self.per_rank  # this rank's share of the batch's prompts
        completions = self._generate(index, self._prompt_indices(index)[first : first + self.per_rank], first)
        rows = [self.prompts.row(c.prompt_index) for c in completions]
        tok = self.inputs.tokenizer
        texts = tok.batch_decode([c.ids for c in completions], skip_special_tokens=True)
        # TRL's shapes: a chat prompt's completion is a list of one assistant message (with tools: of
        # every turn, tool results included), and the prompt the one the episode began with.
        answers = [[{"role": "assistant", "content": t}] if isinstance(r["prompt"], list) else t for r, t in zip(rows, texts)]
        prompts = [r["prompt"] for r in rows]
        columns = {key: [r.get(key) for r in rows] for key in rows[0] if key != "prompt"}
        if self.agent:
            answers, prompts = [c.turns for c in completions], [c.prompt_turns for c in completions]
            if self.inputs.toolbox.environments:  # TRL passes reward functions each completion's environment
                columns["environments"] = [c.episode.environment for c in completions]
        error = None
        try:
            per_func = self.rewards.score(prompts, answers, [c.ids for c in completions], columns, step)
        except RewardError as e:
            error, per_func = e, torch.zeros(len(completions), len(self.rewards.names))
        message = dist.first_message(None if error is None else str(error))  # every rank stops, none waits
        if message is not None:
            raise error or RewardError(message)
        # The whole batch's rewards, lengths (the model's own tokens), clipping, and (tools) the calls,
        # failed and cut, and every token after the prompt, on every rank: [completions, functions + 6].
        counts = [list(c.episode.counts.values()) if c.episode else [0, 0, 0] for c in completions]  # calls, failures, truncated
        facts = [[sum(c.generated), c.clipped, *n, len(c.ids)] for c, n in zip(completions, counts)]
        local = torch.cat([per_func, torch.tensor(facts, dtype=torch.float32).reshape(-1, 6)], dim=1)
        gathered = dist.all_gather_rows(local)
        gathered, tools = gathered[:, :-4], gathered[:, -4:].sum(0)
        self._check_scored(gathered[:, :-2], index)  # the same on every rank: all stop, or none
        adv, total, stats = advantages(gathered[:, :-2], self.rewards.weights, cfg.num_generations, cfg.scale_rewards, self.rewards.names)
        # Groups with no signal (rewards that tie) train nothing: their advantage is 0 exactly, where
        # TRL's float32 mean can leave a residue of ~1e-5 (tests/training/test_rewards.py).
        adv[stats["zero_std_groups"].repeat_interleave(cfg.num_generations)] = 0.0
        mine = slice(first * cfg.num_generations, (first + self.per_rank) * cfg.num_generations)
        adv, total = adv[mine], total[mine]
        lengths, clipped = gathered[:, -2], gathered[:, -1]
        for name, value in {
            **{k: v for k, v in stats.items() if k != "zero_std_groups"},
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": clipped.mean(),
            **(self._tool_metrics(tools, lengths.sum(), len(gathered)) if self.agent else {}),
        }.items():
            self.model.note(name, torch.as_tensor(value, dtype=torch.float32).reshape(1))
        self.samples = [
            {"generation": index, "prompt": r["prompt"], "completion": t, "reward": x if math.isfinite(x) else None, "advantage": a}
            for r, t, x, a in list(zip(rows, texts, total.tolist(), adv.tolist()))[:SAMPLES_LOGGED]
        ]
        return self._micro_batches(completions, adv)

    @staticmethod
    def _tool_metrics(tools: torch.Tensor, generated: torch.Tensor, completions: int) -> dict:
        """TRL's tools/* metrics over the whole generation batch (calls per completion, the share of
        calls that failed: raised, timed out, unknown tool), and lora-tune's: the share of results cut
        to --max-tool-result-tokens, and of the completions' tokens that tools and the template wrote
        (masked out of the loss)."""
        made, failed, cut, total = tools.tolist()
        return {
            "tools/call_frequency": made / completions,
            "tools/failure_frequency": failed / made if made else 0.0,
            "tools/truncated_frequency": cut / made if made else 0.0,
            "tools/masked_token_share": 1.0 - float(generated) / total if total else 0.0,
        }

    def _check_scored(self, per_func: torch.Tensor, index: int) -> None:
        """A generation batch no function scored (None for every completion) has no advantage to
        learn from: the step would train nothing, with a NaN reward. Stopped as a failing function
        is, naming them. Completions that only some functions leave unscored are TRL's multi-task
        case (advantage 0 where none scored), said once."""
        unscored = unscorable(per_func)
        if bool(unscored.all()):
            names = ", ".join(self.rewards.names)
            raise RewardError(
                f"reward function{'s' if len(self.rewards.names) > 1 else ''} {names} returned None for all {len(unscored)} "
                f"completions of generation batch {index} (nothing to learn from): return a number for each completion it scores"
            )
        if bool(unscored.any()) and not self.warned_unscored:
            log.warning(
                "%d of %d completions of generation batch %d got None from every reward function: they train with advantage 0 "
                "(as TRL); make sure one function scores each completion",
                int(unscored.sum()),
                len(unscored),
                index,
            )
            self.warned_unscored = True

    # --- generation --------------------------------------------------------------------------------
    def _generate(self, index: int, prompts: list[int], first: int) -> list[Completion]:
        """G completions of each prompt; `first`: the place of this rank's first prompt in the whole
        generation batch (the seeds follow the place, not the rank)."""
        cfg, G = self.cfg, self.cfg.num_generations
        seeds = [hash((cfg.seed, index, p, i, j)) % (2**63) for p, i in enumerate(prompts, start=first) for j in range(G)]
        if self.agent:
            return self._episodes(index, prompts, seeds)
        ids = [list(self.prompts[i].input_ids) for i in prompts]
        rows = [prompt for prompt in ids for _ in range(G)]
        sampled = self.generator.generate(index, rows, seeds)
        return [Completion(prompts[row // G], ids[row // G], s.ids, s.clipped, s.logps) for row, s in enumerate(sampled)]

    def _episodes(self, index: int, prompts: list[int], seeds: list[int]) -> list[Completion]:
        """With tools: each completion an episode of its own (a fresh environment, its prompt rendered
        with its tools and what reset() said), played turn by turn (lora_tune.training.episodes)."""
        G, toolbox = self.cfg.num_generations, self.inputs.toolbox
        owners = [i for i in prompts for _ in range(G)]
        rows = [self.prompts.row(i) for i in owners]
        episodes = [toolbox.episode(row) for row in rows]
        started = [self.agent.prompt(row, e, f"prompt {i}") for i, row, e in zip(owners, rows, episodes)]
        rolled = self.agent.run(self.generator, index, [ids for _, ids in started], seeds, episodes)
        return [
            Completion(i, r.prompt_ids, r.ids, r.clipped, r.logps, r.mask, turns, r.turns, r.episode)
            for i, (turns, _), r in zip(owners, started, rolled)
        ]

    def close(self) -> None:
        self.generator.close()

    # --- micro-batches -----------------------------------------------------------------------------
    def _micro_batches(self, completions: list[Completion], adv: torch.Tensor) -> list[MicroBatch]:
        cfg = self.cfg
        trained = [not (cfg.mask_truncated and c.clipped) for c in completions]
        tokens = sum(sum(c.generated) for c, t in zip(completions, trained) if t)
        # Completions with nothing to learn: masked, or advantage 0 with no KL term (exactly zero loss and gradient).
        skip = [not t or (cfg.beta == 0 and cfg.loss_type != "bnpo" and a == 0) for t, a in zip(trained, adv.tolist())]
        kept = [k for k in range(len(completions)) if not skip[k]]
        ga = cfg.grad_accum
        if cfg.loss_type == "bnpo":  # bnpo averages over each micro-batch as built: every completion stays
            kept = list(range(len(completions)))
        elif len(kept) < ga:  # a micro-batch each: skipped completions fill in (their loss and gradient are exactly 0)
            kept = sorted(kept + [k for k in range(len(completions)) if skip[k]][: ga - len(kept)])
        # Exactly --grad-accum micro-batches, their sizes within one of each other, in order.
        bounds = [round(j * len(kept) / ga) for j in range(ga + 1)]
        groups = [kept[bounds[j] : bounds[j + 1]] for j in range(ga)]
        batches = [self._collate([completions[k] for k in g], adv[g], [trained[k] for k in g]) for g in groups]
        # The sampler's log-probability of every label token of each micro-batch, in label order (vLLM's).
        sampling = (
            [
                torch.tensor(
                    [x for k in g if trained[k] for x, m in zip(completions[k].sampling_logps, completions[k].generated) if m],
                    dtype=torch.float32,
                )
                for g in groups
            ]
            if self.corrects
            else None
        )
        # The step's normalisers count every completion (and every trained token), run or skipped.
        batches[0].counts["sequences"] += len(completions) - sum(len(g) for g in groups)
        batches[0].counts["tokens"] += tokens - sum(b.counts["tokens"] for b in batches)
        self._score_fixed_log_probs(batches, sampling)
        return batches

    def _collate(self, completions: list[Completion], adv: torch.Tensor, trained: list[bool]) -> MicroBatch:
        """Prompt + completion per sequence, packed into one row (or one per row, padded) by the data
        stage's collate; labels on the tokens the model generated, of trained completions only (tool
        results and the template's tokens between turns are IGNORE: TRL's tool_mask)."""
        samples = [
            Sample(c.prompt_ids + c.ids, [IGNORE] * len(c.prompt_ids) + [x if t and m else IGNORE for x, m in zip(c.ids, c.generated)])
            for c, t in zip(completions, trained)
        ]
        packed = self.inputs.levers.packing
        batch = collate([samples] if packed else [[s] for s in samples], self.pad_id, packed, units=True)
        inputs = {k: batch.inputs[k] for k in GRPO_INPUTS if k in batch.inputs}
        inputs["advantages"] = adv.float()
        counts = {"sequences": len(completions), "tokens": batch.label_tokens}
        return MicroBatch(inputs, batch.tokens, batch.label_tokens, counts, "sequences")

    def _score_fixed_log_probs(self, batches: list[MicroBatch], sampling: list[torch.Tensor] | None) -> None:
        """The reference's per-token log-probabilities (beta > 0) and the policy's as it generated
        (--num-iterations > 1: the old policy of the later iterations; vLLM's samples: the trainer's
        own, against which the sampler's are corrected), once per generation batch."""
        wanted = [("ref_logps", True)] if self.cfg.beta else []
        wanted += [("old_logps", False)] if self.cfg.num_iterations > 1 or sampling is not None else []
        totals = {"tokens": float(sum(b.counts["tokens"] for b in batches))}
        for batch in batches:
            batch.set_step_totals(totals)
        for key, reference in wanted:
            self.model.recorded, self.model.record_reference = [], reference
            try:
                self.engine.evaluate(batches)  # collective where weights are sharded: every rank, the same micro-batches
                scored = self.model.recorded
            finally:
                self.model.recorded, self.model.record_reference = None, False
            for batch, logps in zip(batches, scored):
                batch.inputs[key] = logps
        if sampling is not None:
            self._correct_sampling(batches, sampling)

    def _correct_sampling(self, batches: list[MicroBatch], sampling: list[torch.Tensor]) -> None:
        """TRL's importance weights of vLLM's samples (objectives.grpo.sampling_correction) into each
        micro-batch, and its `sampling/*` metrics over the whole generation batch (every rank)."""
        cfg = self.cfg
        deltas, ratios = [], []
        for batch, sampled in zip(batches, sampling):
            inputs = batch.inputs
            targets = inputs["labels"][:, 1:].reshape(-1)
            owners = inputs["sequence_ids"][:, 1:].reshape(-1)[targets != IGNORE]
            old = inputs["old_logps"]
            if old.shape != sampled.shape:  # the sampler's tokens are the ones trained, one log-probability each
                raise RuntimeError(f"{old.numel()} label tokens, {sampled.numel()} sampled log-probabilities")
            n = inputs["advantages"].numel()
            mode = cfg.vllm_importance_sampling_mode
            weights = sampling_correction(
                old, sampled, owners, n, mode, cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
            )
            inputs["importance_weights"] = weights
            delta = (old - sampled).abs()
            deltas.append(delta[~torch.isnan(delta)])
            if mode.startswith("sequence"):  # one ratio per sequence that has tokens here
                first = torch.zeros(n, dtype=torch.bool).index_fill_(0, owners.unique(), True)
                ratios.append(weights.new_zeros(n).index_copy_(0, owners, weights)[first])
            else:
                ratios.append(weights)
        delta, ratio = torch.cat(deltas), torch.cat(ratios)
        # [sum, count, max] of the differences, [sum, count, min, max] of the ratios: this rank's, then every rank's.
        local = torch.tensor(
            [[delta.sum(), delta.numel(), delta.max() if delta.numel() else 0.0, ratio.sum(), ratio.numel(),
              ratio.min() if ratio.numel() else math.inf, ratio.max() if ratio.numel() else -math.inf]],
            dtype=torch.float64,
        )  # fmt: skip
        every = dist.all_gather_rows(local)
        counts = every[:, 1].sum().clamp(min=1), every[:, 4].sum().clamp(min=1)
        for name, value in {
            "sampling/sampling_logp_difference/mean": every[:, 0].sum() / counts[0],
            "sampling/sampling_logp_difference/max": every[:, 2].max(),
            "sampling/importance_sampling_ratio/mean": every[:, 3].sum() / counts[1],
            "sampling/importance_sampling_ratio/min": every[:, 5].min() if every[:, 4].sum() else torch.tensor(0.0),
            "sampling/importance_sampling_ratio/max": every[:, 6].max() if every[:, 4].sum() else torch.tensor(0.0),
        }.items():
            self.model.note(name, torch.as_tensor(value, dtype=torch.float32).reshape(1))

    # --- logging and checkpoints -------------------------------------------------------------------
    def write_samples(self, step: int) -> None:
        """A few of the newest generation's prompts, completions and rewards (rank 0, logging steps)."""
        if not self.samples:
            return
        with open(self.inputs.output_dir / SAMPLES_FILE, "a", encoding="utf-8") as f:
            for sample in self.samples:
                f.write(json.dumps({"step": step, **sample}, default=str) + "\n")
        self.samples = []

    def save(self, folder) -> None:
        """The current generation batch, when a resume from this checkpoint still trains on it
        (--num-iterations > 1): the policy that generated it is gone by then."""
        if self.current is None or self.cfg.num_iterations == 1:
            return
        index, batches = self.current
        tensors = {
            f"{k}.{name}": t.contiguous() for k, b in enumerate(batches) for name, t in b.inputs.items() if not name.endswith("_in_step")
        }
        meta = [{"tokens": b.tokens, "label_tokens": b.label_tokens, "counts": b.counts} for b in batches]
        write_safetensors(folder / ROLLOUT_FILE.format(rank=dist.rank()), tensors, {"generation": str(index), "batches": json.dumps(meta)})

    def load(self, folder) -> None:
        path = folder / ROLLOUT_FILE.format(rank=dist.rank())
        if not path.is_file():
            return
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        batches = []
        for k, m in enumerate(json.loads(meta["batches"])):
            inputs = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.split(".", 1)[0] == str(k)}
            batches.append(MicroBatch(inputs, m["tokens"], m["label_tokens"], m["counts"], "sequences"))
        self.current = (int(meta["generation"]), batches)
