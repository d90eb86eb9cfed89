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
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from lora_tune.loss import IGNORE

GROUP_WINDOW = 64  # micro-batches per length-sorting window


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
    inputs: dict[str, torch.Tensor]  # what the model's forward takes
    tokens: int  # real (non-padding) tokens
    label_tokens: int  # tokens that carry a label (the loss is summed over these)


def collate(rows: list[list], pad_id: int, packed: bool) -> MicroBatch:
    """Rows of samples (each with input_ids and labels) into tensors, right-padded to the longest
    row. Packed: the samples of a row are concatenated with their own position_ids and no attention
    mask (padding is a block of its own). Unpacked: one sample per row and a 2-D attention mask."""
    width = max(sum(len(s.input_ids) for s in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    tokens = 0
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            n = len(s.input_ids)
            ids[r, at : at + n] = torch.as_tensor(s.input_ids)
            labels[r, at : at + n] = torch.as_tensor(s.labels)
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)
        tokens += at
    label_count = int((labels[:, 1:] != IGNORE).sum())
    if packed:
        return MicroBatch({"input_ids": ids, "labels": labels, "position_ids": positions}, tokens, label_count)
    mask = (positions.new_zeros(positions.shape) + torch.arange(width)) < torch.tensor(
        [sum(len(s.input_ids) for s in row) for row in rows]
    ).unsqueeze(1)
    return MicroBatch({"input_ids": ids, "labels": labels, "attention_mask": mask.long()}, tokens, label_count)
