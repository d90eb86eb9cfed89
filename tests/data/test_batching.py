"""Packing, length grouping, epoch order and collation; packing changes nothing in the math."""

from __future__ import annotations

import pytest
import torch

from lora_tune.config import TrainConfig
from lora_tune.data.batching import IGNORE, MicroBatches, collate, pack_best_fit_decreasing, passes, shard_rows
from lora_tune.data.prepare import Sample
from lora_tune.models.adapter import add_lora
from lora_tune.models.loading import load_base_model
from lora_tune.training.objectives.sft import CausalLMLoss


def test_best_fit_decreasing_packs_every_sample_once_within_capacity():
    lengths = [900, 700, 600, 400, 300, 300, 200, 100, 100, 50, 50, 24]
    rows = pack_best_fit_decreasing(lengths, 1024)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 1024 for row in rows)
    # 3,724 tokens need at least 4 rows of 1,024; best fit reaches that here.
    assert len(rows) == 4
    assert rows == pack_best_fit_decreasing(lengths, 1024)  # deterministic


def test_passes_keep_rows_whole_in_order_within_their_tokens():
    """A CPU's passes over a micro-batch: consecutive rows up to the padded-token budget (rows x the
    longest row), a row at least, every row once and in order."""
    lengths = [600, 400, 1000, 300, 200, 100, 1500, 50]
    rows = [[0, 1], [2], [3, 4], [5], [6], [7]]  # 1,000 / 1,000 / 500 / 100 / 1,500 / 50 tokens
    groups = passes(rows, lengths, 1024)
    assert [row for group in groups for row in group] == rows
    assert groups == [[[0, 1]], [[2]], [[3, 4], [5]], [[6]], [[7]]]
    assert passes(rows, lengths, 10_000) == [rows]
    assert passes(rows[:2], lengths, 2000) == [rows[:2]]  # 2 x 1,000 padded tokens fit exactly


def test_an_epoch_covers_each_row_once_and_the_next_reshuffles():
    batches = MicroBatches([5] * 10, micro_batch_size=2, seed=1, packing=False, group_by_length=False, max_seq_len=64)
    assert len(batches) == 5
    first = [row[0] for j in range(5) for row in batches.rows(j)]
    second = [row[0] for j in range(5, 10) for row in batches.rows(j)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    again = MicroBatches([5] * 10, 2, 1, False, False, 64)
    assert again.rows(7) == batches.rows(7)  # any position recomputes exactly (resume)


def test_packed_epochs_shuffle_the_same_rows():
    lengths = [30, 20, 10, 40, 25, 5, 60, 15]
    batches = MicroBatches(lengths, micro_batch_size=1, seed=3, packing=True, group_by_length=True, max_seq_len=64)
    epoch0 = [tuple(batches.rows(j)[0]) for j in range(len(batches))]
    epoch1 = [tuple(batches.rows(len(batches) + j)[0]) for j in range(len(batches))]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    assert sorted(i for row in epoch0 for i in row) == list(range(len(lengths)))


def test_grouping_by_length_cuts_padding():
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(5, 500, (512,), generator=g)]

    def padding(group: bool) -> int:
        b = MicroBatches(lengths, micro_batch_size=4, seed=0, packing=False, group_by_length=group, max_seq_len=512)
        total = 0
        for j in range(len(b)):
            widths = [lengths[row[0]] for row in b.rows(j)]
            total += max(widths) * len(widths) - sum(widths)
        return total

    assert padding(True) < 0.2 * padding(False)


def test_packed_collate_restarts_positions_and_masks_boundaries():
    a = Sample([1, 11, 12, 2], [IGNORE, 11, 12, 2])
    b = Sample([1, 21, 2], [IGNORE, IGNORE, 2])
    c = Sample([1, 31], [IGNORE, 31])
    batch = collate([[a, b], [c]], pad_id=2, packed=True)
    assert "attention_mask" not in batch.inputs  # block-diagonal attention comes from position_ids
    assert batch.inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4]]
    assert batch.inputs["labels"].tolist() == [[IGNORE, 11, 12, 2, IGNORE, IGNORE, 2], [IGNORE, 31] + [IGNORE] * 5]
    assert batch.tokens == 9 and batch.label_tokens == 5


def test_unpacked_collate_masks_padding_even_when_pad_equals_eos():
    eos = 2
    short, long = Sample([1, 5, eos], [IGNORE, 5, eos]), Sample([1, 6, 7, 8, eos], [IGNORE, 6, 7, 8, eos])
    batch = collate([[short], [long]], pad_id=eos, packed=False)  # the dangerous configuration: pad id == eos id
    assert batch.inputs["labels"][0].tolist() == [IGNORE, 5, eos, IGNORE, IGNORE]  # the real EOS keeps its label
    assert batch.inputs["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.tokens == 8 and batch.label_tokens == 6


@pytest.fixture(scope="module")
def lora_model(tiny_model):
    cfg = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision="fp32", rank=4, dropout=0.0, gradient_checkpointing=False)
    peft_model = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, "b")
    with torch.no_grad():  # B starts at zero: give the adapter a value so its gradients are not trivially A-only
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.02)
    return CausalLMLoss(peft_model, chunk_size=0)


def samples(n: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = [1] + torch.randint(3, 500, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
        labels = [IGNORE] + [t if k % 3 else IGNORE for k, t in enumerate(ids[1:])]
        out.append(Sample(ids, labels))
    return out


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch.inputs, num_items_in_batch=batch.label_tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(lora_model):
    data = samples(6, seed=1)
    packed = collate([data[:3], data[3:]], pad_id=0, packed=True)
    padded = collate([[s] for s in data], pad_id=0, packed=False)
    assert packed.label_tokens == padded.label_tokens
    loss_p, grads_p = loss_and_grads(lora_model, packed)
    loss_u, grads_u = loss_and_grads(lora_model, padded)
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=0)
    scale = max(float(g.abs().max()) for g in grads_u.values())
    for k in grads_u:
        torch.testing.assert_close(grads_p[k], grads_u[k], rtol=1e-4, atol=1e-6 * scale)


def test_a_packed_sample_never_sees_its_neighbours(lora_model):
    """Change one token of the middle sample of a packed row: every other sample's logits stay
    bit-identical (a loss comparison alone is too weak a test on a tiny random model), and each
    sample's logits are its logits alone."""
    data = samples(3, seed=2)
    changed = [
        data[0],
        Sample([*data[1].input_ids[:-2], (data[1].input_ids[-2] + 7) % 500 + 3, data[1].input_ids[-1]], data[1].labels),
        data[2],
    ]
    peft_model = lora_model.peft_model

    def packed_logits(row):
        with torch.no_grad():
            return peft_model(**{k: v for k, v in collate([row], 0, True).inputs.items() if k != "labels"}).logits[0]

    base, again = packed_logits(data), packed_logits(changed)
    n0, n1 = len(data[0].input_ids), len(data[1].input_ids)
    assert torch.equal(again[:n0], base[:n0]) and torch.equal(again[n0 + n1 :], base[n0 + n1 :])
    assert not torch.equal(again[n0 : n0 + n1], base[n0 : n0 + n1])  # the changed sample itself did change
    with torch.no_grad():
        alone = peft_model(input_ids=torch.tensor([data[2].input_ids])).logits[0]
    torch.testing.assert_close(base[n0 + n1 :], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_sequence_parallel_slices_are_the_whole_row_computed_first(packed):
    """Each rank's slice of a row (--sequence-parallel): the width padded to a multiple of the group,
    positions and shifted labels computed on the whole row, the whole row's positions carried, and
    the slices' counts adding up to the micro-batch's."""
    a = Sample([1, 11, 12, 2], [IGNORE, 11, 12, 2])
    b = Sample([1, 21, 2], [IGNORE, IGNORE, 2])
    c = Sample([1, 31], [IGNORE, 31])
    rows = [[a, b], [c]] if packed else [[a], [b], [c]]
    whole = collate(rows, pad_id=0, packed=packed)
    width = whole.inputs["input_ids"].shape[1]  # 7 packed, 4 padded
    parts = [shard_rows(whole, 3, i, pad_id=0) for i in range(3)]
    padded = -(-width // 3) * 3
    ids = torch.cat([p.inputs["input_ids"] for p in parts], dim=1)
    assert ids.shape[1] == padded and torch.equal(ids[:, :width], whole.inputs["input_ids"]) and (ids[:, width:] == 0).all()
    positions = torch.cat([p.inputs["position_ids"] for p in parts], dim=1)
    assert all(torch.equal(p.inputs["row_position_ids"], positions) for p in parts)
    if packed:
        assert positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4] and positions[1].tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 6]
    else:  # a row is one sample, its padding after it
        assert positions.tolist() == [list(range(padded))] * 3
    shifted = torch.cat([p.inputs["shifted_labels"] for p in parts], dim=1)
    expected = torch.full_like(shifted, IGNORE)
    expected[:, : width - 1] = whole.inputs["labels"][:, 1:]
    assert torch.equal(shifted, expected)  # position t holds the label of token t + 1, across slice boundaries
    assert sum(p.label_tokens for p in parts) == whole.label_tokens == sum(p.counts["label_tokens"] for p in parts)
    assert sum(p.tokens for p in parts) == whole.tokens == 9
