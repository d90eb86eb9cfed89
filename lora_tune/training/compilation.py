"""`--compile`: regional torch.compile of the decoder layers and of the chunked loss's per-chunk step.

Regional, the way torchtune compiles: each decoder layer is compiled on its own (`Module.compile`),
not the whole model. The layers of a model run the same code, and Dynamo treats their parameters as
inputs, so one graph serves every layer: compile time is paid for one layer, whatever the depth.
LoRA's layers are inside the region (peft wraps the layer's linears before it is compiled), and so
is transformers' gradient checkpointing: Dynamo captures `torch.utils.checkpoint` as a higher-order
op and recomputes the compiled region in backward.

Shapes: packed micro-batches change width from one to the next, so the regions are compiled with
dynamic shapes from the start (`dynamic=True`) instead of once per width. Graphs still vary by kind
of batch and pass, never by batch: PyTorch specialises sizes 0 and 1 (a micro-batch of one row, a
loss chunk of one position); transformers passes attention a mask only when a row packs several
samples; without checkpointing the first layer's input needs no gradient and the others' do; with
partial checkpointing, checkpointed and kept layers differ; evaluation (no gradients) and a DPO
reference pass (adapter off) are passes of their own. The default setup on a CPU (every layer
checkpointed but the last) compiles 3 graphs in its first step (a checkpointed layer, the kept one,
the loss chunk) and at most 10 over a run; `CompileStats` counts them and the log says how many. Sample
generations run eagerly (decoding with a KV cache would recompile at every step).

The compiled artifacts go to PyTorch's own on-disk caches (Inductor's FX graph cache and
AOTAutograd's cache, on by default): a second run of the same model and setup finds them and starts
in seconds; the log says hits and misses.

Engines: one device, FSDP2 (its hooks stay outside the compiled layer: Dynamo skips them) and
ZeRO-1/2 (plain parameters) are verified compiled == eager on 2 ranks. What does not compile is
refused before loading: bitsandbytes' 8/4-bit layers (their kernels are opaque to Inductor), ZeRO-3
(its parameter hooks inside the layers split them into many graphs, slower than eager), and a
machine without the compiler Inductor generates code with (a C++ compiler on CPU, Triton on a GPU).
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
from torch._dynamo.utils import compilation_time_metrics, counters
from torch.utils._triton import has_triton
from transformers import PreTrainedModel

from lora_tune.errors import UserError
from lora_tune.models.head import cross_entropy_chunk
from lora_tune.models.structure import decoder_body
from lora_tune.training.objectives.sft import CausalLMLoss

RECOMPILE_LIMIT = 64  # graphs per code object before Dynamo falls back to eager (its default: 8)

# Dynamo's name for the time it spends compiling a frame: tracing, then Inductor's forward and
# backward graphs (AOTAutograd compiles the backward with the forward).
_COMPILE_TIME = "_compile.compile_inner"


def refusal(precision: str, backend_compiles: bool, backend: str) -> str | None:
    """Why `--compile` can't run this configuration, or None (from the configuration alone).
    `backend`: how tables name the backend setup ("ZeRO-3")."""
    if precision in ("8bit", "4bit"):
        return f"bitsandbytes' {precision} layers don't compile (Inductor can't trace their kernels); use --precision bf16 or leave it out"
    if not backend_compiles:
        return (
            f"{backend} gathers its sharded weights from hooks inside the layers, which split the compiled layers into many "
            "small graphs (slower than eager); use --zero 2 or --backend fsdp with it, or leave it out"
        )
    return None


def check_cell(cfg, spec) -> None:
    """`refusal` for the configuration's backend cell (`spec`: its BackendSpec), as the one-line error."""
    reason = refusal(cfg.precision, spec.compiles(cfg.zero), spec.label(cfg.zero)) if cfg.compile else None
    if reason:
        raise UserError(f"--compile: {reason}")


def toolchain_refusal(device: torch.device) -> str | None:
    """Why Inductor can't generate code on this machine, or None."""
    if device.type == "cuda":
        if not has_triton():
            return "Inductor needs Triton on a GPU and it is not installed; pip install triton, or leave it out"
    elif device.type == "cpu":
        # The compiler Inductor will call: $CXX, else its configured default (g++).
        compiler = os.environ.get("CXX") or next(c for c in torch._inductor.config.cpp.cxx if c)
        if not shutil.which(compiler.split()[0]):
            where = f"$CXX ({compiler})" if os.environ.get("CXX") else f"{compiler} (Inductor's default; set $CXX to another)"
            return f"Inductor needs a C++ compiler on a CPU and {where} was not found; install it, or leave --compile out"
    else:
        return f"regional compilation is verified on CPU and CUDA only, not {device.type}; leave it out"
    return None


@contextlib.contextmanager
def settings(enabled: bool):
    """The Dynamo settings a compiled run needs, for the run only (a notebook's process keeps its own).

    transformers' `kernels` integration sets a context variable around attention's forward; inside a
    checkpointed region Dynamo refuses a side effect it would have to replay in the recompute. It is
    set and reset within the same forward, so not replaying it in backward changes nothing.
    """
    if not enabled:
        yield
        return
    # Every decoder layer runs one code object, whose graphs vary by kind of pass (see above): a run
    # with evaluation and a DPO reference pass, or several runs in one notebook, outgrow Dynamo's
    # default of 8 graphs per code object, past which it silently runs the layers eagerly.
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True, recompile_limit=RECOMPILE_LIMIT):
        yield


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of the decoder body: the elements of its outermost ModuleLists (not
    the experts listed inside a block, nor a sub-model's own layers)."""

    def walk(module):
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList):
                yield from child
            elif not isinstance(child, PreTrainedModel):
                yield from walk(child)

    return list(walk(decoder_body(model)))


def compile_regions(loss_module) -> None:
    """`--compile`: the decoder layers of the model inside `loss_module` (what an engine trains), and
    the chunked cross-entropy's per-chunk function (its softmax passes fused; the chunks' sizes
    vary, so dynamic as well). The preference objectives' log-probabilities stay eager."""
    compile_layers(loss_module.get_base_model())
    if isinstance(loss_module, CausalLMLoss) and loss_module.chunk_size != 0:
        loss_module.chunk_fn = torch.compile(cross_entropy_chunk, dynamic=True)


def compile_layers(model) -> int:
    """Compile each decoder layer of `model` (a transformers model, LoRA already injected) in place;
    lazily: a layer's first forward compiles it. Returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


class CompileStats:
    """What Dynamo and Inductor did since this object was made: graphs compiled, seconds spent
    compiling, on-disk cache hits and misses. Read from PyTorch's own counters."""

    def __init__(self):
        self.start = self._now()

    @staticmethod
    def _now() -> dict[str, float]:
        seconds = sum(compilation_time_metrics.get(_COMPILE_TIME, ()))
        return {
            "graphs": counters["stats"]["unique_graphs"],
            "seconds": seconds,
            "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "cache_misses": counters["inductor"]["fxgraph_cache_miss"],
        }

    def since_start(self) -> dict[str, float]:
        now = self._now()
        return {k: now[k] - self.start[k] for k in now}

    def line(self) -> str:
        s = self.since_start()
        return (
            f"compiled {s['graphs']:.0f} graph(s) in {s['seconds']:.1f} s "
            f"(Inductor cache: {s['cache_hits']:.0f} hit(s), {s['cache_misses']:.0f} miss(es))"
        )
