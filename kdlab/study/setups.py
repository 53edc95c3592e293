"""What ``kdlab estimate`` reads of a fit's configuration (:class:`Setup`): the machine (GPUs, strategy,
precision) from ``trainer``, and the models, batch and lengths from ``model`` for each stage it models:
:class:`~kdlab.stages.distill.DistillModule` (:func:`kdlab.study.estimate.setup_from_config`),
:class:`~kdlab.stages.sft.SFTModule` (:func:`sft_setup`) and :class:`~kdlab.stages.grpo.GRPOModule`
(:func:`grpo_setup`). Shapes come from the models' configs (:mod:`kdlab.study.shapes`), never their weights."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kdlab.study.shapes import Shape, model_shape

GiB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Setup:
    """Everything the arithmetic reads, per rank."""

    student: Shape  # the trained model (SFT's ``model``, GRPO's ``policy``)
    teacher: Shape | None
    student_dtype: str = "float32"
    teacher_dtype: str = "bfloat16"
    checkpointing: bool = False
    decoders: tuple[str, ...] = ("teacher",)  # the models kdlab's decoder runs: "student", "teacher"
    cached_teacher: bool = False  # teacher log-probs from a top-k cache
    other_teachers: tuple[Shape, ...] = ()  # several teachers: the in-process members after the first (their weights)
    vllm_fraction: float = 0.0  # of the GPU's memory, reserved by a vLLM engine
    engine: str = ""  # the model a vLLM engine samples: "student" or "teacher"
    served: bool = False  # the teacher answers from a server (its decodes and scoring happen there)
    objective: str = "ForwardKL"  # or "CrossEntropy" (SFT), "PolicyGradient" (GRPO)
    chunk_size: int = 256
    batch_size: int = 1  # rows per training micro-batch
    accumulate: int = 1
    decode_group: int = 1
    decode_rows: int | None = None  # rows of one decode, when not batch_size x decode_group (GRPO: prompts x group size)
    prompt_tokens: int = 2048
    completion_tokens: int = 512
    row_tokens: int = 0  # packed rows of at most this many tokens (max_tokens_per_row); 0: padded rows
    val_prompts: int = 8
    mixed: bool = False  # 16-bit autocast (bf16-mixed / 16-mixed)
    strategy: str = "single"  # single, ddp, fsdp2, fsdp1
    world: int = 1
    shard: int = 1  # data-parallel size the sharded models are split over
    teacher_sharded: bool = False
    student_fused: bool = True
    teacher_fused: bool = True
    lora_rank: int = 0  # LoRA adapters on the trained model (0: all its weights train)
    adapter_bytes: int = 4  # per LoRA parameter: fp32 (peft's), or 2 under bf16-true / 16-true, which cast the adapters too
    stage: str = "distill"  # distill, sft, grpo
    gpu: bool = True
    gpu_memory: int = 80 * GiB
    notes: list[str] = field(default_factory=list)

    @property
    def trainable(self) -> int:
        """Parameters the optimiser updates: the LoRA adapters (``adapter_bytes`` each), else every weight."""
        return lora_params(self.student, self.lora_rank) if self.lora_rank else self.student.params

    @property
    def rows_per_decode(self) -> int:
        return self.decode_rows if self.decode_rows is not None else self.batch_size * self.decode_group


def lora_params(shape: Shape, rank: int) -> int:
    """LoRA parameters on every attention and MLP projection (:data:`LORA_TARGETS`): ``r x (in + out)`` each."""
    q = shape.heads * shape.head_dim
    sides = (shape.hidden + q) * 2 + (shape.hidden + shape.kv_dim) * 2 + 3 * (shape.hidden + shape.intermediate)
    return shape.layers * rank * sides


def name_of(value: Any) -> tuple[str, dict[str, Any]]:
    """``(class name, init_args)`` of a config value: a ``class_path`` dict, a plain string, or ``None``."""
    if isinstance(value, dict):
        return str(value.get("class_path", "")).rsplit(".", 1)[-1], dict(value.get("init_args") or {})
    return ("" if value is None else str(value)), {}


def style_transfer_rows(args: dict[str, Any]) -> list[int]:
    """The rows a ``StyleTransfer`` callback's ``init_args`` sample for each entry of its ``tasks``: a ``TaskPrompts``
    entry's own ``examples``, else the callback's ``examples`` (200 when not set). Upper bounds: a shorter split gives
    fewer."""
    default, entries = args.get("examples", 200), args.get("tasks")
    rows = []
    for entry in entries if isinstance(entries, list) else []:
        name, entry_args = name_of(entry)
        own = entry_args.get("examples") if name == "TaskPrompts" else None
        rows.append(default if own is None else own)
    return rows


def spec_of(value: Any) -> Any:
    """A :class:`~kdlab.models.loading.ModelSpec` from a config value (a path or a dict), or ``None``."""
    from kdlab.models.loading import ModelSpec

    if value is None or isinstance(value, str):
        return None if value is None else ModelSpec(value)
    return ModelSpec(**{key: item for key, item in dict(value).items() if key in {f.name for f in fields(ModelSpec)}})


def machine(trainer: dict[str, Any], options: dict[str, Any], notes: list[str], gpus: int | None, gpu_memory_gib: float | None) -> dict[str, Any]:
    """The :class:`Setup` fields the ``trainer`` section decides: GPUs (``gpus``, default ``trainer.devices x
    trainer.num_nodes``), strategy and shard size, autocast, accumulation, GPU or CPU, GPU memory (default 80 GiB), the
    bytes of a LoRA parameter."""
    devices, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes") or 1)
    devices = len(devices) if isinstance(devices, (list, tuple)) else int(devices) if str(devices).lstrip("-").isdigit() else devices
    if not isinstance(devices, int) or devices < 1:
        notes.append(f"trainer.devices {devices!r}: 1 GPU per node assumed (pass --gpus)")
        devices = 1
    world = gpus or devices * nodes
    strategy, strategy_args = name_of(trainer.get("strategy"))
    kind = {"ModelParallelStrategy": "fsdp2", "FSDPStrategy": "fsdp1", "fsdp": "fsdp1", "DDPStrategy": "ddp"}.get(strategy)
    kind = kind or ("ddp" if strategy.startswith("ddp") or world > 1 else "single")
    shard = strategy_args.get("data_parallel_size") if kind == "fsdp2" else None
    precision = str(trainer.get("precision") or "32-true")
    accelerator = name_of(trainer.get("accelerator") or "auto")[0].lower()
    return {"world": world, "strategy": kind, "shard": shard if isinstance(shard, int) else world,
            "mixed": precision in ("bf16-mixed", "16-mixed", "bf16", "16"), "accumulate": int(trainer.get("accumulate_grad_batches") or 1),
            "gpu": accelerator not in ("cpu",), "gpu_memory": int((gpu_memory_gib or options.get("gpu_memory_gib") or 80) * GiB), "precision": precision,
            # peft keeps adapters in fp32; a 16-bit true precision casts the whole module, adapters included, to 16 bits
            "adapter_bytes": 2 if precision in ("bf16-true", "16-true") else 4}


def _dtype(precision: str, dtype: str, notes: list[str]) -> str:
    if precision in ("bf16-true", "16-true"):
        notes.append(f"trainer.precision {precision}: the model held in 16 bits")
        return "bfloat16" if precision.startswith("bf16") else "float16"
    return dtype


def _lora_rank(value: Any) -> int:
    if not value:
        return 0
    settings = dict(value) if isinstance(value, dict) else dict(getattr(value, "__dict__", {}))
    targets = settings.get("target_modules")
    if targets is not None and set(targets) != set(LORA_TARGETS):
        raise ValueError(f"lora.target_modules {list(targets)}: kdlab estimate counts adapters on all of {list(LORA_TARGETS)} only")
    return int(settings.get("r") or 256)


def _common(model: dict[str, Any], spec: Any, settings: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    keep = {key: value for key, value in settings.items() if key != "precision"}
    return {**keep, "student": model_shape(spec, "model"), "student_dtype": _dtype(settings["precision"], spec.dtype, notes),
            "checkpointing": bool(spec.gradient_checkpointing), "lora_rank": _lora_rank(model.get("lora")), "notes": notes}


def sft_setup(model: dict[str, Any], trainer: dict[str, Any], gpus: int | None = None, gpu_memory_gib: float | None = None) -> Setup:
    """An :class:`~kdlab.stages.sft.SFTModule` fit: ``batch_size`` rows of ``max_length`` tokens (the cap) per
    micro-batch, the loss from the hidden states and head in chunks (``fused_lm_head``, wherever valid) or from the
    model's ``(B, T, V)`` logits, no decode and no validation. FSDP2 is refused as the stage refuses it
    (:func:`~kdlab.stages.sft.check_sft_strategy`)."""
    spec, notes = spec_of(model.get("model")), []
    if spec is None:
        raise ValueError("model.model: missing")
    settings = machine(trainer, {}, notes, gpus, gpu_memory_gib)
    from kdlab.stages.sft import check_sft_strategy

    check_sft_strategy(settings["strategy"] == "fsdp2")  # the stage's own rule and words: an FSDP2 SFT fit never starts
    return Setup(**_common(model, spec, settings, notes), teacher=None, decoders=(), objective="CrossEntropy", stage="sft",
                 batch_size=int(model.get("batch_size") or 32), prompt_tokens=0, completion_tokens=int(model.get("max_length") or 2048),
                 val_prompts=0, student_fused=model.get("fused_lm_head") is not False and settings["strategy"] != "fsdp1", teacher_fused=False)


def grpo_setup(model: dict[str, Any], trainer: dict[str, Any], gpus: int | None = None, gpu_memory_gib: float | None = None) -> Setup:
    """A :class:`~kdlab.stages.grpo.GRPOModule` fit: one decode of ``batch_size x group_size`` rows on the policy
    (kdlab's decoder, or vLLM's engine with ``VLLMRollouts``), training ``micro_batch_size`` rows at a time, a frozen
    reference only with ``beta > 0``; ``trainer.max_steps`` counts optimiser steps (``mini_batches`` per decode)."""
    spec, notes = spec_of(model.get("policy")), []
    if spec is None:
        raise ValueError("model.policy: missing")
    settings = machine(trainer, {}, notes, gpus, gpu_memory_gib)
    prompts, group = int(model.get("batch_size") or 1), int(model.get("group_size") or 8)
    mini_batches = int(model.get("mini_batches") or 1)
    rows = prompts * group
    per_step = rows // mini_batches  # rows of one optimiser step (one mini-batch)
    micro = min(int(model.get("micro_batch_size") or per_step), per_step)
    settings["accumulate"] = -(-per_step // micro)  # micro-batches per optimiser step (manual optimisation)
    reference = spec_of(model.get("reference")) or spec if float(model.get("beta") or 0.0) > 0 else None
    rollout, _ = name_of(model.get("rollout") or "StudentRollouts")
    setup = Setup(**_common(model, spec, settings, notes), teacher=model_shape(reference, "reference") if reference else None,
                  teacher_dtype=reference.dtype if reference else "bfloat16", decoders=() if rollout == "VLLMRollouts" else ("student",),
                  objective="PolicyGradient", stage="grpo", batch_size=micro, decode_group=-(-rows // micro), decode_rows=rows,
                  prompt_tokens=int(model.get("max_prompt_tokens") or 2048), completion_tokens=int(model.get("max_completion_tokens") or 512),
                  val_prompts=int(model.get("val_batch_size") or 8) * int(model.get("eval_samples") or 1),
                  student_fused=model.get("fused_lm_head") is not False and settings["strategy"] != "fsdp1", teacher_fused=False)
    if rollout == "VLLMRollouts":
        setup.engine = "student"
    return setup
