"""The configs users write: `train`'s, composed from the sections each room declares beside the code
that reads them (one flat schema: the YAML keys and flags stay flat), and `plan`'s, which is
`train`'s plus the hardware. The after-training commands' configs are in `lora_tune.after.options`;
how options are declared and built from YAML and flags, in `lora_tune.options`."""

from __future__ import annotations

from pydantic import Field, field_validator

from lora_tune.after.options import AfterTrainingOptions
from lora_tune.data.options import DataOptions
from lora_tune.engines.options import EngineOptions
from lora_tune.models.options import LoraOptions, ModelOptions
from lora_tune.options import FREE, MATH, size_text
from lora_tune.training.generation.options import VLLMOptions
from lora_tune.training.objectives.options import AgentOptions, GRPOOptions, ObjectiveOptions
from lora_tune.training.options import EvalOptions, OptimOptions, OutputOptions, SpeedOptions

# In the order --help shows them (and a run's lora_tune_config.yaml lists them).
SECTIONS = (
    ModelOptions,
    LoraOptions,
    DataOptions,
    OptimOptions,
    SpeedOptions,
    ObjectiveOptions,
    GRPOOptions,
    AgentOptions,
    VLLMOptions,
    EngineOptions,
    EvalOptions,
    OutputOptions,
    AfterTrainingOptions,
)


# pydantic orders the fields of several bases from the last base to the first: the sections reversed.
class TrainConfig(
    AfterTrainingOptions,
    OutputOptions,
    EvalOptions,
    EngineOptions,
    VLLMOptions,
    AgentOptions,
    GRPOOptions,
    ObjectiveOptions,
    SpeedOptions,
    OptimOptions,
    DataOptions,
    LoraOptions,
    ModelOptions,
):
    """`lora-tune train`: every option of every section, flat."""

    @classmethod
    def resume_rules(cls) -> dict[str, dict]:
        """Each field's behaviour on --resume (`lora_tune.options`: free, math, fixed with its reason)."""
        return {n: f.json_schema_extra or {} for n, f in cls.model_fields.items()}

    @classmethod
    def math_keys(cls) -> list[str]:
        """The settings a checkpoint records: what the run computes (math) and what its state is made of (fixed)."""
        return [n for n, rule in cls.resume_rules().items() if rule.get("resume_rule") in ("math", "fixed")]

    @classmethod
    def sections(cls) -> list[tuple[str, list[str]]]:
        """(title, field names) of each section, in --help's order; a field a subclass adds (plan's
        hardware) comes last, under the subclass's own title."""
        groups = [(s.section, list(s.model_fields)) for s in SECTIONS]
        declared = {name for _, names in groups for name in names}
        extra = [name for name in cls.model_fields if name not in declared]
        return groups + ([(cls.section, extra)] if extra else [])


class PlanConfig(TrainConfig):
    """`lora-tune plan` takes every `train` option (so a training YAML plans as it is) plus the
    hardware; data and output folder are not needed."""

    section = "hardware"

    data: list[str | dict] | None = Field(
        None, json_schema_extra=MATH, description="Not needed for planning (accepted so a training config can be reused)."
    )
    output_dir: str | None = Field(None, json_schema_extra=FREE, description="Not needed for planning.")
    gpus: int | None = Field(None, gt=0, description="GPUs per node (default: --nproc, the processes a training config starts, else 1).")
    nodes: int = Field(1, gt=0, description="Nodes.")
    gpu_memory: str = Field(
        "a100-80",
        description="Memory per GPU: a size with its unit (80GB, 24GiB; a bare number such as 24 is refused, never read as bytes) "
        "or a GPU name: t4, l4, a10g, rtx3090, rtx4090, a100-40, a100-80, h100-80, h200 (also as people shorten them: 4090, "
        "h100, a100-80gb).",
    )
    cpu_memory: str | None = Field(
        None, description="Host memory per node with its unit (e.g. 512GB; a bare number is refused); checked when given."
    )
    print_json: bool = Field(False, json_schema_extra={"flag": "--json"}, description="Print the estimate as JSON (bytes per device).")
    auto: bool = Field(
        False,
        description="Search precision x ZeRO x offload x checkpointing x micro-batch for the fastest setup that fits (with "
        "--max-context: the --sequence-parallel degree that fits the longest rows).",
    )
    max_context: bool = Field(
        False,
        description="Print the longest --max-seq-len that fits this setup (every layer checkpointed, MLPs tiled unless "
        "--tiled-mlp off), in steps of 256 tokens per rank of a row.",
    )

    _sizes = field_validator("gpu_memory", "cpu_memory", mode="before")(size_text)
