"""The SFT loss (lora_tune.training.objectives.sft): through the chunked head it trains the same
LoRA gradients as the model's own full-logits loss."""

from __future__ import annotations

import torch

from lora_tune.config import TrainConfig
from lora_tune.data.batching import collate
from lora_tune.data.prepare import Sample
from lora_tune.models.adapter import add_lora
from lora_tune.models.head import IGNORE
from lora_tune.models.loading import load_base_model
from lora_tune.training.objectives.sft import CausalLMLoss


def test_chunked_and_full_loss_train_the_same_lora_gradients(tiny_model):
    cfg = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision="fp32", rank=4, dropout=0.0)
    peft_model = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, "b")
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.02)
    ids = torch.randint(3, 500, (3, 40), generator=torch.Generator().manual_seed(1)).tolist()
    batch = collate([[Sample(r, [IGNORE] * 10 + r[10:])] for r in ids], pad_id=0, packed=False)
    results = []
    for chunk in (0, 16):
        model = CausalLMLoss(peft_model, chunk)
        peft_model.zero_grad()
        loss = model(**batch.inputs, num_items_in_batch=batch.label_tokens)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}))
    (full, g_full), (chunked, g_chunked) = results
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=0)
    scale = max(float(g.abs().max()) for g in g_full.values())
    for k in g_full:
        torch.testing.assert_close(g_chunked[k], g_full[k], rtol=1e-4, atol=1e-6 * scale)
