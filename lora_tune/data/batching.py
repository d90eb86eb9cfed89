"""From tokenized samples to micro-batches: the order of an epoch, packing, and collation.

Packing (the default): samples are packed into rows of at most `--max-seq-len` tokens by best-fit
decreasing, once (the packing depends only on the lengths, so every epoch and every resume gets the
same rows); each epoch shuffles the rows with the seed. A row's samples keep their own positions
(`position_ids` restart at 0 for each) and no 2-D attention mask is passed, so transformers builds
block-diagonal attention from the positions (varlen kernels with flash-attention): no token attends
across samples. Every sample's first label is masked by the data stage, so no token is trained to
predict the next sample either.

Without packing, each row is one sample, padded to the micro-batch's longest; `--group-by-length`
(the default) sorts samples by length within windows of 64 micro-batches of the epoch's shuffled
order, so micro-batches hold similar lengths and little padding, and then shuffles the micro-batches
of each window.

An epoch's order is computed once and kept (`MicroBatches.rows`), so picking a micro-batch costs
O(1), and any position can be recomputed exactly on resume.

On a CPU a micro-batch's rows go through forward and backward in passes (`passes`): consecutive rows
of at most `PASS_TOKENS` padded tokens together (one row when a row holds more). The loss is summed
over label tokens and divided by the step's totals, so the passes give the step's gradients as one
pass would, like accumulation; the activations are a pass's.

Under `--sequence-parallel N` the ranks of a group share each micro-batch, each holding 1/N of every
row (`shard_rows`).

Image-text data is packed like text where that is exact (`ImageText.packing_refusal`: families whose
image tokens take plain positions and causal attention, LLaVA-style), else trains unpacked; a
micro-batch carries its rows' images as the model's pixel inputs, in the order their tokens come
(decoded here, once per use). A micro-batch without images carries one blank image that nothing
attends to (`with_images`), so every rank runs the same modules in the same order whatever its rows
hold (ZeRO-3 gathers the tower's weights collectively and checks that ranks trace the same modules:
a rank that skipped the tower would leave the others waiting forever).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch
from PIL import Image

from lora_tune.data import images
from lora_tune.models.head import IGNORE

GROUP_WINDOW = 64  # micro-batches per length-sorting window

# Most padded tokens per forward + backward pass on a CPU (a row of more is a pass of its own). A
# CPU's matmuls run at full speed from about a thousand rows, so larger passes only add activations,
# and with them the heap glibc's allocator fragments: torch allocates tensors 64-byte aligned, and
# glibc's aligned allocation (before 2.38) asks its heap for the size plus 96 bytes, so a freed block
# of the same size is never reused unless it has merged with a free neighbour; the heap grows to
# several times a pass's live tensors and stays resident. Measured on the CPU benchmark, 7 steps of 4
# packed rows of 1,024 tokens (benchmarks/train_vs_peers.py, 2 cores): the whole micro-batch in one
# pass peaks at 1,650-1,690 MiB RSS and trains in 27.2 s, passes of 2 rows at 1,180-1,220 MiB in
# 20.5 s, of 1 row (1,024 tokens) at 960-970 MiB in 21 s (less heap to fault in). With rows of 512
# tokens, 8 per micro-batch: passes of 512 / 1,024 / 2,048 tokens / the whole micro-batch peak at
# 853 / 986 / 1,258 / 1,691 MiB and train in 20.0 / 19.2 / 23.2 / 31.9 s.
PASS_TOKENS = 1024


def passes(rows: list[list[int]], lengths: list[int], tokens: int) -> list[list[list[int]]]:
    """A micro-batch's rows (lists of sample indices, `lengths` their samples' tokens) in consecutive
    groups of at most `tokens` padded tokens (rows x the longest row's tokens), a row at least."""
    groups: list[list[list[int]]] = []
    longest = 0
    for row in rows:
        n = sum(lengths[i] for i in row)
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= tokens:
            groups[-1].append(row)
            longest = max(longest, n)
        else:
            groups.append([row])
            longest = n
    return groups


def pack_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per row: longest samples first, each into the fullest row it still fits.
    Deterministic (ties broken by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    # (space left, row number), kept sorted: the best fit is the first row with enough space.
    space: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(space, (n, -1))
        if k < len(space):
            left, row = space.pop(k)
            rows[row].append(i)
            bisect.insort(space, (left - n, row))
        else:
            rows.append([i])
            bisect.insort(space, (capacity - n, len(rows) - 1))
    return rows


def permutation(n: int, seed: int, epoch: int) -> list[int]:
    """A fresh, reproducible shuffle per epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch)).tolist()


class MicroBatches:
    """The global sequence of micro-batches, across epochs; each is a list of rows, a row a list of
    sample indices."""

    def __init__(self, lengths: list[int], micro_batch_size: int, seed: int, packing: bool, group_by_length: bool, max_seq_len: int):
        self.lengths = lengths
        self.mbs = micro_batch_size
        self.seed = seed
        self.packing = packing
        self.group_by_length = group_by_length and not packing
        self.packed_rows = pack_best_fit_decreasing(lengths, max_seq_len) if packing else None
        self.n_rows = len(self.packed_rows) if packing else len(lengths)
        self.per_epoch = math.ceil(self.n_rows / micro_batch_size)
        self._epoch: tuple[int, list[list[list[int]]]] | None = None

    def __len__(self) -> int:
        """Micro-batches per epoch."""
        return self.per_epoch

    def _batches_of_epoch(self, epoch: int) -> list[list[list[int]]]:
        order = permutation(self.n_rows, self.seed, epoch)
        if self.packing:
            rows = [self.packed_rows[r] for r in order]
        elif self.group_by_length:
            rows = []
            window = self.mbs * GROUP_WINDOW
            for start in range(0, len(order), window):
                chunk = sorted(order[start : start + window], key=lambda i: (-self.lengths[i], i))
                batches = [chunk[j : j + self.mbs] for j in range(0, len(chunk), self.mbs)]
                shuffle = permutation(len(batches), self.seed + 1, epoch * 100003 + start)
                rows += [[i] for k in shuffle for i in batches[k]]
        else:
            rows = [[i] for i in order]
        return [rows[j * self.mbs : (j + 1) * self.mbs] for j in range(self.per_epoch)]

    def rows(self, global_index: int) -> list[list[int]]:
        """The rows of the `global_index`-th micro-batch, counting across epochs."""
        epoch, position = divmod(global_index, self.per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, self._batches_of_epoch(epoch))
        return self._epoch[1][position]


@dataclass
class MicroBatch:
    inputs: dict[str, torch.Tensor]  # what the loss module's forward takes
    tokens: int  # real (non-padding) tokens
    label_tokens: int  # tokens that carry a label
    # What the step's loss is divided by, summed over the step's micro-batches on every rank:
    # `normalizer` names the count passed as num_items_in_batch (label tokens for SFT, units for
    # preference objectives); the others reach the loss as `<name>_in_step` inputs.
    counts: dict[str, int] = field(default_factory=dict)
    normalizer: str = "label_tokens"
    row_tokens: tuple[int, ...] = ()  # real tokens of each row (they come first, padding after)

    @property
    def weight(self) -> int:
        """How much this micro-batch weighs in an average over micro-batches (evaluation)."""
        return self.counts[self.normalizer]

    def set_step_totals(self, totals: dict[str, float]) -> None:
        """The step's totals of the counts other than the normalizer, as `<name>_in_step` inputs."""
        self.inputs.update({f"{name}_in_step": torch.tensor(float(value)) for name, value in totals.items() if name != self.normalizer})


def _sequences(sample) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each sequence a sample holds (a pair: two)."""
    bounds = [*sample.starts, len(sample.input_ids)]
    return [(sample.input_ids[a:b], sample.labels[a:b]) for a, b in zip(bounds, bounds[1:])]


BLANK_SIDE = 56  # pixels: the smallest image every processor takes (Qwen-style grids merge 2 x 2 patches of 14)


def with_images(inputs: dict[str, torch.Tensor], samples: list, image_text, blank: bool = True) -> dict[str, torch.Tensor]:
    """`inputs` with the pixel inputs of the samples' images, in order, and the token types the model
    wants. Without any image, a blank one is added after the first row's end, its tokens unattended
    (attention mask 0; packed rows: a sample of its own) and untrained: the model runs exactly as on every other
    micro-batch (embeddings, vision tower, projector, decoder, in that order, on every rank), and the
    real tokens' outputs are those of the text alone (nothing attends to padding). `blank` False (one
    process: no rank to keep in step): an image-less micro-batch is the text alone."""
    files = [f for s in samples for f in s.images]
    pictures = [images.load(f, f, image_text.max_pixels, image_text.min_pixels) for f in files]
    if not pictures and not blank:  # one process: nothing to keep in step, the text alone
        return {**inputs, **image_text.token_type_inputs(inputs["input_ids"])}
    if not pictures:
        pictures = [Image.new("RGB", (BLANK_SIDE, BLANK_SIDE))]
        blank_ids = torch.tensor(image_text.expand(image_text.placeholder, pictures), dtype=torch.long)
        rows, n = inputs["input_ids"].shape[0], blank_ids.numel()
        extra = {"input_ids": 0, "labels": IGNORE, "attention_mask": 0}
        inputs = {**inputs, **{k: torch.cat([inputs[k], inputs[k].new_full((rows, n), v)], dim=1) for k, v in extra.items() if k in inputs}}
        inputs["input_ids"][0, -n:] = blank_ids
        if "position_ids" in inputs:  # packed: the blank is a sample of its own (positions from 0), which nothing attends to
            inputs["position_ids"] = torch.cat([inputs["position_ids"], torch.arange(n).expand(rows, n)], dim=1)
    return {**inputs, **image_text.pixel_inputs(pictures), **image_text.token_type_inputs(inputs["input_ids"])}


def pad_token_id(tokenizer) -> int:
    """The id rows are padded with: the tokenizer's padding token, else its EOS (many causal LMs have no pad token)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def collate(rows: list[list], pad_id: int, packed: bool, units: bool = False, image_text=None, blank_image: bool = True) -> MicroBatch:
    """Rows of samples (each with input_ids and labels) into tensors, right-padded to the longest
    row. Packed: the sequences of a row are concatenated, each with its own position_ids (restarting
    at 0) and no attention mask (padding is a block of its own). Unpacked: one sequence per row and
    a 2-D attention mask.

    `units`: each sample is a unit of an objective that scores whole sequences (a preference pair,
    a KTO row with its KL sequence): the batch also says which sequence every position belongs to
    (`sequence_ids`, -1 for none), how many label tokens each sequence has, the units' KTO labels
    and, when precomputed, their reference log-probabilities; the loss divides by units.

    `image_text` (image-text data, `lora_tune.models.processors.ImageText`): the rows' images too, and a
    blank one for an image-less micro-batch when `blank_image` (several ranks: `with_images`)."""
    if not packed:  # each sequence a row of its own
        rows = [[(seq, s)] for row in rows for s in row for seq in _sequences(s)]
    else:
        rows = [[(seq, s) for s in row for seq in _sequences(s)] for row in rows]
    width = max(sum(len(ids) for (ids, _), _ in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    owners = torch.full((len(rows), width), -1, dtype=torch.long)
    tokens, n_sequences = 0, 0
    for r, row in enumerate(rows):
        at = 0
        for (seq_ids, seq_labels), _ in row:
            n = len(seq_ids)
            ids[r, at : at + n] = torch.as_tensor(seq_ids)
            labels[r, at : at + n] = torch.as_tensor(seq_labels)
            positions[r, at : at + n] = torch.arange(n)
            owners[r, at : at + n] = n_sequences
            n_sequences += 1
            at += n
        positions[r, at:] = torch.arange(width - at)
        tokens += at
    label_count = int((labels[:, 1:] != IGNORE).sum())
    inputs = {"input_ids": ids, "labels": labels}
    if packed:
        inputs["position_ids"] = positions
    else:
        lengths = torch.tensor([sum(len(seq_ids) for (seq_ids, _), _ in row) for row in rows])
        inputs["attention_mask"] = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    row_tokens = tuple(sum(len(seq_ids) for (seq_ids, _), _ in row) for row in rows)
    if image_text is not None:
        inputs = with_images(inputs, list({id(s): s for row in rows for _, s in row}.values()), image_text, blank_image)
    if not units:
        return MicroBatch(inputs, tokens, label_count, {"label_tokens": label_count}, row_tokens=row_tokens)
    samples = list(dict.fromkeys(id(s) for row in rows for _, s in row))  # each unit once, in order
    by_id = {id(s): s for row in rows for _, s in row}
    per_sequence = torch.zeros(n_sequences, dtype=torch.long)
    per_sequence.index_add_(0, owners[:, 1:][labels[:, 1:] != IGNORE], torch.ones(label_count, dtype=torch.long))
    inputs["sequence_ids"] = owners
    inputs["sequence_label_tokens"] = per_sequence
    inputs["unit_labels"] = torch.tensor([by_id[k].label for k in samples], dtype=torch.long)
    if all(by_id[k].reference is not None for k in samples):
        inputs["reference_logps"] = torch.tensor([v for k in samples for v in by_id[k].reference], dtype=torch.float32)
    # The tokens the first sequences of the units predict (a pair's chosen: all but its first token): ORPO's NLL divides by these.
    first_sequence = int((torch.bincount(owners[owners >= 0], minlength=n_sequences)[0::2] - 1).sum())
    return MicroBatch(inputs, tokens, label_count, {"units": len(samples), "chosen_tokens": first_sequence}, "units", row_tokens)


def shard_rows(batch: MicroBatch, parts: int, index: int, pad_id: int) -> MicroBatch:
    """Sequence parallelism (`lora_tune.models.sequence_parallel`): this rank's `index`-th of `parts`
    consecutive slices of every row of a (non-unit) micro-batch. Everything that needs the whole row
    is computed on it first: its width padded to a multiple of `parts` (padding continues the last
    sample's positions; no real token attends to it, nothing is trained on it), position ids (an
    unpacked row is one sample, its padding at its end), labels shifted by one (each position holds
    the token it predicts, so no label crosses a slice boundary), and the row's position ids whole
    (`row_position_ids`: where samples start, for attention). The counts are the slice's: summed
    over the group's ranks they are the micro-batch's."""
    ids, labels = batch.inputs["input_ids"], batch.inputs["labels"]
    rows, width = ids.shape
    positions = batch.inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(width).expand(rows, -1)
    extra = -width % parts
    if extra:
        ids = torch.cat([ids, ids.new_full((rows, extra), pad_id)], dim=1)
        labels = torch.cat([labels, labels.new_full((rows, extra), IGNORE)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(extra)], dim=1)
    shifted = torch.cat([labels[:, 1:], labels.new_full((rows, 1), IGNORE)], dim=1)
    size = ids.shape[1] // parts
    mine = slice(index * size, (index + 1) * size)
    real = torch.arange(ids.shape[1]).unsqueeze(0) < torch.tensor(batch.row_tokens).unsqueeze(1)
    label_count = int((shifted[:, mine] != IGNORE).sum())
    inputs = {
        "input_ids": ids[:, mine].contiguous(),
        "position_ids": positions[:, mine].contiguous(),
        "shifted_labels": shifted[:, mine].contiguous(),
        "row_position_ids": positions.contiguous(),
    }
    return MicroBatch(inputs, int(real[:, mine].sum()), label_count, {"label_tokens": label_count}, row_tokens=batch.row_tokens)
