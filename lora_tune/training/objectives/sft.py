"""Supervised fine-tuning: the next tokens of the data, the loss summed over label tokens and
divided by the step's label count, through the chunked head (`lora_tune.models.head`) so the
`[tokens x vocab]` logits never exist. `--loss-chunk-size 0` computes the loss through the model's
own forward instead."""

from __future__ import annotations

import torch

from lora_tune.models.head import SOFTCAP_KEYS, auto_chunk_size, cross_entropy_chunk, linear_cross_entropy, shifted_hidden
from lora_tune.models.sequence_parallel import SequenceGroup, plain_attention, shard_hidden


class CausalLMLoss(torch.nn.Module):
    """The peft model whose forward returns the loss (summed over label tokens / `num_items_in_batch`).
    `chunk_size`: label tokens per chunk of the head + cross-entropy; None picks it per micro-batch
    (`auto_chunk_size`); 0 runs the model's own full-logits loss."""

    def __init__(self, peft_model, chunk_size: int | None):
        super().__init__()
        self.peft_model = peft_model
        self.chunk_size = chunk_size
        self.chunk_fn = cross_entropy_chunk  # --compile: compiled (lora_tune.training.compilation)
        config = peft_model.get_base_model().config.get_text_config(decoder=True)
        self.softcap = next((getattr(config, k) for k in SOFTCAP_KEYS if getattr(config, k, None)), None)
        self.sequence_group: SequenceGroup | None = None  # --sequence-parallel: set by the recipe once ranks are up

    def get_base_model(self):
        return self.peft_model.get_base_model()

    def generate(self, **kwargs):
        """The policy's (base + adapter) completions, by transformers' `generate`: a method of the
        module the backends wrap, so a sharding backend's hooks can run around it. Each rank
        generates whole sequences, so sequence parallelism's attention is off around it."""
        with plain_attention(self.peft_model.get_base_model()):
            return self.peft_model.generate(**kwargs)

    def forward(
        self,
        input_ids,
        num_items_in_batch,
        labels=None,
        attention_mask=None,
        position_ids=None,
        shifted_labels=None,
        row_position_ids=None,
        **vision,  # image-text data: pixel inputs and token types (lora_tune.data.batching.with_images)
    ):
        if shifted_labels is not None:  # this rank's slice of every row (--sequence-parallel: lora_tune.data.batching.shard_rows)
            hidden = shard_hidden(self.peft_model, input_ids, position_ids, row_position_ids, self.sequence_group)
            targets = shifted_labels.reshape(-1)
        elif self.chunk_size == 0:
            return self.peft_model(
                input_ids=input_ids,
                labels=labels,
                attention_mask=attention_mask,
                position_ids=position_ids,
                num_items_in_batch=num_items_in_batch,
                **vision,
            ).loss
        else:
            hidden, targets = shifted_hidden(self.peft_model, input_ids, labels, attention_mask, position_ids, vision)
        head = self.peft_model.get_base_model().get_output_embeddings()
        return linear_cross_entropy(
            hidden, head.weight, targets, num_items_in_batch, self.chunk(hidden, head), self.softcap, head.bias, self.chunk_fn
        )

    def chunk(self, hidden: torch.Tensor, head) -> int:
        return self.chunk_size or auto_chunk_size(hidden.shape[0], hidden.shape[1], head.weight.shape[0])

    def take_stats(self) -> dict[str, tuple[float, int]]:
        """What the objective measured since it was last asked (name -> (sum, count)): none for SFT."""
        return {}
