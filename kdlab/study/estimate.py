"""``kdlab estimate``'s arithmetic: the memory a :class:`~kdlab.stages.distill.DistillModule` fit needs on
each GPU, and the work of one optimiser step, from the models' configs alone (no weights are read); an
:class:`~kdlab.stages.sft.SFTModule` or :class:`~kdlab.stages.grpo.GRPOModule` fit is read by
:mod:`kdlab.study.setups` into the same terms (SFT: no decode, the loss on whole logits; GRPO: one decode of
``batch_size x group_size`` rows; LoRA: the adapters, their gradients and moments only, in fp32, or in 16 bits under
``bf16-true`` / ``16-true``, which cast them too). The time of a step and
of a whole run: :mod:`kdlab.study.step_time`, :mod:`kdlab.study.run_time`.

A step decodes (the rollout), then trains its micro-batches, then steps the optimiser, so::

    total = persistent + max(decode, training (teacher forward | objective | backward), optimiser step, validation) + reserved

persistent: student weights, gradients (kept between steps: Lightning sets them to ``None`` just before the
next backward), AdamW's two moments (in the weights' dtype), the frozen teacher, DDP's gradient buckets,
each divided by the data-parallel size where sharded (FSDP2, FSDP1). decode: one batched decode of
``batch_size x rollout_micro_batches`` prompts per rank: each decoding model's KV cache and workspace
(:func:`decode_terms`), FSDP2's whole gathered models (:func:`kdlab.stages.sharding.gathered_for_decoding`).
training, one micro-batch: the student's activations (:func:`student_training_terms`), the teacher's
no-grad forward, the objective's buffers (:func:`objective_workspace`), FSDP's gathered units, autocast's
bf16 weight copies. optimiser step: AdamW's temporaries. validation: the student decoding
``val_batch_size x eval_samples`` prompts (callbacks are not counted). reserved: a vLLM engine's
``gpu_memory_utilization x GPU memory``. Lengths are the caps (``max_prompt_tokens``,
``max_completion_tokens``): a bound. A micro-batch is ``batch_size`` rows of ``prompt + completion`` tokens, or,
packed (``max_tokens_per_row``), its sequences at their caps packed into rows of that budget
(:func:`training_rows`): the same tokens at the caps, in fewer, longer rows whose attention mask is ``R x L^2`` under
activation checkpointing, and each sequence's own ``S^2`` without it (segment attention, :func:`attention_span`). Checked against allocator-level peaks on the CPU (``tests/test_estimate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdlab.study.setups import (  # noqa: F401
    BYTES,
    LORA_TARGETS,
    GiB,
    Setup,
    grpo_setup,
    lora_params,
    machine,
    name_of,
    sft_setup,
    spec_of,
)
from kdlab.study.setups import _lora_rank as _lora
from kdlab.study.shapes import (  # noqa: F401 - their callers' names
    HUB_ID,
    PUBLISHED,
    Shape,
    model_shape,
    published_shape,
    shape_of_config,
)

CLOSED_FORM = ("ForwardKL", "ReverseKL", "TotalVariation")
"""Objectives whose loss and gradient come from the shared row statistics (no autograd on a chunk)."""
_name, _spec = name_of, spec_of  # their callers' names


@dataclass
class Term:
    key: str
    phase: str  # one of PHASES, or "training" (alive in all three training phases)
    bytes: float
    formula: str


PHASES = ("persistent", "decode", "training: teacher forward", "training: objective", "training: backward", "optimiser step",
          "validation", "reserved")
PEAKS = PHASES[1:-1]  # one after another within a step: the total takes the largest


@dataclass
class Estimate:
    setup: Setup
    terms: list[Term]
    work: dict[str, float]
    time: Any = None  # a kdlab.study.run_time.RunTime, when the command asked for one

    @staticmethod
    def alive(term: Term, phase: str) -> bool:
        return term.phase == phase or (term.phase == "training" and phase.startswith("training:"))

    def phase(self, name: str) -> float:
        """Bytes alive in phase ``name`` (beyond the persistent ones)."""
        return sum(term.bytes for term in self.terms if self.alive(term, name))

    @property
    def peak_phase(self) -> str:
        return max(PEAKS, key=self.phase)

    @property
    def total(self) -> float:
        return self.phase("persistent") + self.phase(self.peak_phase) + self.phase("reserved")

    @property
    def largest(self) -> Term:
        """The largest of the terms the total adds (persistent, the largest phase's, reserved)."""
        return max((t for t in self.terms if any(self.alive(t, p) for p in ("persistent", self.peak_phase, "reserved"))), key=lambda t: t.bytes)

    @property
    def fits(self) -> bool:
        return self.total <= self.setup.gpu_memory


def layer_bytes(shape: Shape, mixed: bool, length: int) -> int:
    """Bytes per token one decoder layer saves for backward, measured with ``saved_tensors_hooks`` on
    Llama/Qwen2 layers: fp32 ``32h + 8kv + 16I`` (both RMSNorms' input and output, q, k, v, the attention
    output, the MLP's gate, up, activation and product), 16-bit autocast ``32h + 4kv + 8I``; plus the
    attention mask SDPA saves per layer as a float bias, ``T`` values per token."""
    h, kv, inter = shape.hidden, shape.kv_dim, shape.intermediate
    return (32 * h + 4 * kv + 8 * inter + 2 * length) if mixed else (32 * h + 8 * kv + 16 * inter + 4 * length)


def training_rows(setup: Setup) -> tuple[int, int]:
    """``(R, L)``: the rows and row length of one micro-batch's forward at the caps (``S = prompt + completion``):
    ``(batch_size, S)`` padded; packed (``row_tokens``), ``max(1, row_tokens // S)`` sequences per row, so
    ``R = ceil(batch_size / per_row)`` rows of ``L = min(batch_size, per_row) x S`` tokens (the last row padded to L)."""
    length = setup.prompt_tokens + setup.completion_tokens
    if not setup.row_tokens:
        return setup.batch_size, length
    per_row = max(1, setup.row_tokens // length)
    return -(-setup.batch_size // per_row), min(setup.batch_size, per_row) * length


def attention_span(setup: Setup) -> tuple[int, int]:
    """``(keys per query the attention's saved bias holds, bytes of the boolean mask)`` for one micro-batch: padded,
    ``(S, B x S^2)``; packed with activation checkpointing (the block-diagonal mask over each row,
    :func:`~kdlab.rollouts.packing.segments_apply`), ``(L, R x L^2)``; packed without it, kdlab's segment attention,
    which attends each sequence within its own slot of an ``(B, S)`` batch: ``(S, B x S^2)``, as padded."""
    rows, length = training_rows(setup)
    if setup.row_tokens and not setup.checkpointing:
        length = setup.prompt_tokens + setup.completion_tokens
        return length, setup.batch_size * length**2
    return length, rows * length**2


def student_training_terms(setup: Setup, tokens: int, residual: int) -> list[Term]:
    """The student's activations for one micro-batch of ``R x L`` tokens (:func:`training_rows`), alive through all of
    training: without checkpointing every layer's :func:`layer_bytes` (the backward frees them layer by layer as it
    makes the gradients); with activation checkpointing each layer's input (``h x residual bytes``), and in the backward
    one layer recomputed at a time. Outside the layers: ``16h`` bytes per token and the boolean mask (:func:`attention_span`)."""
    s, (rows, length) = setup.student, training_rows(setup)
    span, mask = attention_span(setup)
    per_layer = layer_bytes(s, setup.mixed, span)
    outside = 16 * s.hidden * tokens + mask
    if not setup.checkpointing:  # the backward frees each layer's activations as it makes its gradients
        return [Term("activations", "training", s.layers * per_layer * tokens + outside,
                     f"{tokens} tokens x ({s.layers} layers x {per_layer} B + {16 * s.hidden} B outside the layers) + mask")]
    return [Term("activations", "training", (s.layers + 1) * s.hidden * residual * tokens + outside,
                 f"{tokens} tokens x (({s.layers} + 1) checkpointed layer inputs x {s.hidden} x {residual} B + {16 * s.hidden} B outside the layers) + mask"),
            Term("recomputed layer", "training: backward", per_layer * tokens, f"{tokens} tokens x {per_layer} B: one layer's activations at a time")]


def objective_workspace(setup: Setup, rows: int, tokens: int) -> tuple[float, str]:
    """The objective's buffers for a micro-batch of ``rows`` completion positions (:mod:`kdlab.objectives.kernels`).
    With ``c = min(chunk_size, rows)`` and ``k`` rows per block (the chunk on a GPU, ``2^18 / V`` on the CPU):
    every block has ``p_s``, ``p_t`` and ``scratch`` ``(k, V)`` fp32 and upcast copies of 16-bit rows; a fused
    head holds the model's ``(c, V)`` logits chunk in its hidden dtype (the student's also its fp32 chunk
    gradient and the fp32 ``(V, H)`` head gradient; the teacher its final hidden states); the logits path holds
    the model's whole ``(B, C, V)`` logits (the student's gradient takes over their storage). Objectives
    without a closed form (JSD, sampled KLs) add four ``(c, V)`` fp32 autograd temporaries."""
    s, t, vocab = setup.student, setup.teacher, setup.student.vocab
    c = max(1, min(setup.chunk_size, rows))
    if setup.objective == "CrossEntropy":  # SFTModule.loss: token_logprobs over (c, V) chunks
        size = 2 if setup.mixed or BYTES[setup.student_dtype] == 2 else 4
        chunks = 3 * c * vocab * 4  # the chunk's fp32 logits, their exponentials and the logit gradient
        if setup.student_fused:  # a 16-bit head is upcast once; its gradient is the "head gradient" term
            upcast = vocab * s.hidden * 4 if BYTES[setup.student_dtype] == 2 else 0
            return (chunks + upcast, f"3 x ({c}, {vocab}) fp32 chunk buffers" + (f" + the fp32 ({vocab}, {s.hidden}) head" if upcast else ""))
        return rows * vocab * 2 * size + chunks, f"({rows}, {vocab}) logits and their gradient x {size} B + 3 x ({c}, {vocab}) fp32 chunk buffers"
    k = setup.chunk_size if setup.gpu else max(1, min(setup.chunk_size, (1 << 18) // vocab))
    total, parts = 3 * k * vocab * 4, [f"3 x ({k}, {vocab}) fp32 blocks"]
    if setup.student_fused:
        size = 2 if (setup.strategy == "fsdp2" and setup.mixed) or BYTES[setup.student_dtype] == 2 else 4
        total += c * vocab * (size + 4) + vocab * s.hidden * 4 + rows * s.hidden * size + (k * vocab * 4 if size != 4 else 0)
        parts.append(f"student ({c}, {vocab}) chunk + its fp32 gradient + fp32 ({vocab}, {s.hidden}) head gradient")
    else:
        size = 2 if setup.mixed or BYTES[setup.student_dtype] == 2 else 4
        total += rows * vocab * size + (k * vocab * 4 if size != 4 else 0)
        parts.append(f"student logits ({rows}, {vocab}) x {size} B")
    if setup.cached_teacher:
        total += c * vocab * 4
        parts.append(f"cached teacher expanded to ({c}, {vocab})")
    elif t is not None:
        size = 2 if setup.mixed or BYTES[setup.teacher_dtype] == 2 else 4
        held = (c * vocab + tokens * t.hidden if setup.teacher_fused else rows * vocab) * size
        total += held + (k * vocab * 4 if size != 4 else 0)
        parts.append(f"teacher ({c}, {vocab}) chunk + its final hidden states" if setup.teacher_fused else f"teacher logits ({rows}, {vocab}) x {size} B")
    if setup.objective not in CLOSED_FORM:
        total += 4 * c * vocab * 4
        parts.append(f"{setup.objective}: 4 x ({c}, {vocab}) fp32 autograd temporaries")
    return total, " + ".join(parts)


def decode_terms(setup: Setup, prompts: int, phase: str, models: tuple[str, ...]) -> list[Term]:
    """KV caches and the decode workspace of ``models`` decoding ``prompts`` prompts together, as kdlab's decoder
    (:class:`~kdlab.rollouts.static_cache.StaticCacheLM`) allocates them: each cache preallocated for ``L`` positions,
    ``P + C`` rounded up to :data:`~kdlab.rollouts.static_cache.CACHE_BUCKET`, from the prefill on; the workspace is the
    prefill's largest layer for one forward's rows ``r`` (``r x P x (3I + 4h)`` in the compute dtype, with the boolean
    ``r x P x L`` mask and its float copy; ``r`` = ``prompts``, at most :data:`~kdlab.rollouts.static_cache.PREFILL_TOKENS`
    ``// P``: a larger batch is prefilled a group of rows at a time) or a token step's fp32 ``prompts x V`` log-probs,
    probabilities and entropies (6 per model). Every prompt is counted prefilled whole: prompts that begin alike are
    prefilled once (``share_prefix``), so for them the prefill term is a bound."""
    from kdlab.rollouts.static_cache import CACHE_BUCKET, PREFILL_TOKENS

    cached = -(-(setup.prompt_tokens + max(setup.completion_tokens, 1)) // CACHE_BUCKET) * CACHE_BUCKET
    rows = min(prompts, max(1, PREFILL_TOKENS // max(setup.prompt_tokens, 1)))
    terms, prefills, steps = [], [], 0.0
    for role in models:
        shape = setup.student if role == "student" else setup.teacher
        size = 2 if setup.mixed or BYTES[setup.student_dtype if role == "student" else setup.teacher_dtype] == 2 else 4
        per_token = 2 * shape.layers * shape.kv_dim * size
        terms.append(Term(f"KV cache ({role})", phase, prompts * cached * per_token,
                          f"{prompts} prompts x {cached} positions ({setup.prompt_tokens} + {setup.completion_tokens} rounded up to "
                          f"{CACHE_BUCKET}) x {shape.layers} layers x 2 x {shape.kv_dim} x {size} B"))
        prefills.append(rows * setup.prompt_tokens * ((3 * shape.intermediate + 4 * shape.hidden) * size + (1 + size) * cached))
        steps += 6 * prompts * shape.vocab * 4
    return [*terms, Term("decode workspace", phase, max(max(prefills), steps), f"max(prefill of {rows} row(s) per forward: rows x P x (3I + 4h) x bytes "
                         "+ the (P, L) mask and its float copy; token step: 6 x prompts x V x 4 B per model)")]


def estimate(setup: Setup) -> Estimate:
    """Every term of ``setup``'s per-GPU memory and the work of one optimiser step (module docstring)."""
    s, t = setup.student, setup.teacher
    sb, tb = BYTES[setup.student_dtype], BYTES[setup.teacher_dtype]
    n = setup.shard if setup.strategy in ("fsdp2", "fsdp1") else 1
    tn = n if setup.teacher_sharded else 1
    where, twhere = (f" / {n} (sharded)" if n > 1 else ""), (f" / {tn} (sharded)" if tn > 1 else "")
    billions = f"{s.params / 1e9:.3f}B"
    unsharded_accumulation = setup.strategy == "fsdp2" and setup.accumulate > 1 and n > 1
    trainable, tb_size = setup.trainable, (setup.adapter_bytes if setup.lora_rank else sb)  # fp32 adapters, 16 bits under *-true
    cast = " (the 16-bit true precision casts the adapters too)" if setup.adapter_bytes == 2 else ""
    adapters = f" + {trainable / 1e6:.1f}M LoRA (r {setup.lora_rank}) x {tb_size} B{cast}" if setup.lora_rank else ""
    trained = f"{trainable / 1e6:.1f}M LoRA params" if setup.lora_rank else billions
    terms = [Term("student weights", "persistent", s.params * sb / n + (trainable * tb_size / n if setup.lora_rank else 0), f"{billions} params x {sb} B{adapters}{where}"),
             # FSDP2 reduce-scatters once per optimiser step (kdlab.stages.sharding.require_gradient_sync): between a step's
             # micro-batches each rank holds the whole unsharded gradient
             Term("student gradients", "persistent", trainable * tb_size / (1 if unsharded_accumulation else n),
                  f"{trained} x {tb_size} B" + (" (whole: FSDP2 accumulates unsharded between a step's micro-batches)" if unsharded_accumulation else where)),
             Term("optimiser (AdamW)", "persistent", 2 * trainable * tb_size / n, f"2 moments x {trained} x {tb_size} B{where}")]
    if t is not None:
        terms.append(Term("teacher weights", "persistent", t.params * tb / tn, f"{t.params / 1e9:.3f}B params x {tb} B{twhere}"))
    for index, other in enumerate(setup.other_teachers, 2):  # several in-process teachers: each one's weights
        terms.append(Term(f"teacher {index} weights", "persistent", other.params * tb / tn, f"{other.params / 1e9:.3f}B params x {tb} B{twhere}"))
    if setup.strategy == "ddp":
        terms.append(Term("DDP gradient buckets", "persistent", trainable * tb_size, f"a copy of the gradients: {trained} x {tb_size} B"))
    if setup.vllm_fraction:
        terms.append(Term("vLLM engine", "reserved", setup.vllm_fraction * setup.gpu_memory,
                          f"gpu_memory_utilization {setup.vllm_fraction} x {setup.gpu_memory / GiB:g} GiB"))
    gather = 2 if setup.mixed else None
    sharded = setup.strategy in ("fsdp2", "fsdp1") and n > 1
    root = t.root_params if sharded and setup.teacher_sharded else 0  # no backward reshards it
    if root:
        terms.append(Term("teacher root unit", "persistent", root * (gather or tb), f"FSDP keeps a root gathered after its forward: {root / 1e9:.3f}B x {gather or tb} B"))
    cast = setup.mixed and sb == 4 and not sharded  # autocast caches bf16 copies of the fp32 student's weights
    casts = f"bf16 casts of the fp32 student: {billions} x 2 B"
    if setup.decoders:
        terms += decode_terms(setup, setup.rows_per_decode, "decode", setup.decoders)
        for role in [role for role in setup.decoders if sharded and (role == "student" or setup.teacher_sharded)]:
            shape, size = (s, gather or sb) if role == "student" else (t, gather or tb)
            whole = setup.strategy == "fsdp2"  # FSDP1 gathers unit by unit, at every token
            terms.append(Term(f"gathered {role}" if whole else f"FSDP gathered units ({role})", "decode",
                              ((shape.params if whole else shape.root_params + 2 * shape.layer_params) - (root if role == "teacher" else 0)) * size,
                              f"whole {role} for the decode: {shape.params / 1e9:.3f}B x {size} B" if whole else f"{role} root + 2 layers gathered"))
        if cast and "student" in setup.decoders:
            terms.append(Term("autocast weight copies", "decode", s.params * 2, casts))
    rows, length = training_rows(setup)
    tokens = rows * length
    residual = 2 if (setup.strategy == "fsdp2" and setup.mixed) or sb == 2 else 4
    terms += student_training_terms(setup, tokens, residual)
    workspace, formula = objective_workspace(setup, setup.batch_size * setup.completion_tokens, tokens)
    terms.append(Term("logits / fused workspace", "training: objective", workspace, formula))
    if setup.student_fused and not setup.lora_rank:  # the fused head's gradient reaching the weight (tied: summed with the embedding's own)
        terms.append(Term("head gradient", "training: backward", (2 if s.tied else 1) * s.vocab * s.hidden * 4, f"{'2 x ' if s.tied else ''}({s.vocab}, {s.hidden}) x 4 B"))
    if t is not None:
        size = 2 if setup.mixed or tb == 2 else 4
        terms.append(Term("teacher forward", "training: teacher forward", tokens * ((t.layers + 1) * t.hidden + 3 * t.intermediate + 4 * t.hidden) * size,
                          f"no grad: {tokens} tokens x ({t.layers + 1} hidden states x {t.hidden} + one layer's 3I + 4h) x {size} B"))
    if sharded:
        units = (s.root_params + 2 * s.layer_params) * (gather or sb) + 2 * s.layer_params * 4
        formula = "student root + 2 layers gathered, 2 layers' fp32 gradients before reduce-scatter"
        if setup.teacher_sharded:
            units, formula = units + (t.root_params - root + 2 * t.layer_params) * (gather or tb), formula + f"; teacher {'' if root else 'root + '}2 layers"
        terms.append(Term("FSDP gathered units", "training", units, formula))
    if cast:
        terms.append(Term("autocast weight copies", "training", s.params * 2, casts + ", kept for backward"))
    step = trainable * tb_size / n if setup.gpu else 2 * (lora_params(s, setup.lora_rank) // (7 * s.layers) if setup.lora_rank else s.largest_tensor) * tb_size
    terms.append(Term("AdamW step temporaries", "optimiser step", step, "foreach: one copy of the local weights" if setup.gpu else "two copies of the largest tensor"))
    if setup.val_prompts:
        terms += decode_terms(setup, setup.val_prompts, "validation", ("student",))  # kdlab's decoder, also beside vLLM
    if cast:
        terms.append(Term("autocast weight copies", "validation", s.params * 2, casts))
    elif sharded:
        terms.append(Term("FSDP gathered units", "validation", (s.root_params + 2 * s.layer_params) * (gather or sb), "student root + 2 layers"))
    return Estimate(setup, terms, step_work(setup))


def step_work(setup: Setup) -> dict[str, float]:
    """Per rank and optimiser step: prompts (rows), decodes (GRPO: ``1 / mini_batches`` of one), decode forwards
    (``completion tokens x decodes`` for each decoding model), decoded and trained tokens, and FLOPs: the trained
    model's ``2 x params x tokens`` forward, ``2 x`` its backward to the activations, ``2 x`` more for the weight
    gradients when every weight trains (LoRA: the adapters' are negligible), ``2 x`` more for activation
    checkpointing's recompute (so 6, 8; LoRA 4, 6); ``2 x params x tokens`` for the teacher's (GRPO: the
    reference's) forward and for every decoding model over ``prompt + completion`` tokens."""
    s, t = setup.student, setup.teacher
    prompts = setup.batch_size * setup.accumulate
    decodes = setup.accumulate / max(setup.decode_group, 1)
    decodes = int(decodes) if decodes == int(decodes) else decodes
    models = setup.decoders or ((setup.engine,) if setup.engine else ())
    tokens = prompts * (setup.prompt_tokens + setup.completion_tokens)
    decoding = sum(t.params if role == "teacher" and t is not None else s.params for role in models)
    passes = 2 + 2 + (0 if setup.lora_rank else 2) + (2 if setup.checkpointing else 0)
    flops = passes * s.params * tokens + (2 * t.params * tokens if t is not None else 0) + 2 * decoding * tokens
    return {"prompts": prompts, "decodes": decodes if models else 0, "decode_forwards": decodes * setup.completion_tokens * len(models),
            "decoded_tokens": prompts * setup.completion_tokens if models else 0, "trained_tokens": tokens, "flops": flops, "ranks": setup.world}


def teacher_models(model: dict[str, Any]) -> tuple[list[Any], bool]:
    """The in-process teacher models (:class:`~kdlab.models.loading.ModelSpec`) of a DistillModule config, every member
    of several teachers included, and whether a top-k cache stands for a teacher: each teacher source's class says
    from its settings (:meth:`kdlab.teachers.base.TeacherSource.config_models`), so served teachers and the student's
    own base count none. Reads the ``teacher`` slot and its earlier spellings (``teachers``, a ``CachedTeacherRollouts``
    rollout)."""
    import importlib

    def visit(value: Any) -> tuple[list[Any], bool]:
        if value is None:
            return [], False
        if isinstance(value, str) or (isinstance(value, dict) and "class_path" not in value):
            return [_spec(value)], False
        module, _, name = str(value["class_path"]).rpartition(".")
        source = getattr(importlib.import_module(module), name)
        return source.config_models(dict(value.get("init_args") or {}), visit)

    if model.get("teachers"):  # the earlier spelling: entries of model / served / cache
        entries = [entry or {} for entry in model["teachers"].values()]
        return [_spec(entry["model"]) for entry in entries if entry.get("model")], any(entry.get("cache") for entry in entries)
    if model.get("served_teacher") or model.get("base_teacher"):
        return [], False
    rollout, rollout_args = _name(model.get("rollout") or "TeacherRollouts")
    if rollout == "CachedTeacherRollouts" or rollout_args.get("teacher_cache"):
        return [], True  # the cache replaces the teacher's weights (its tokenizer only is read)
    return visit(model.get("teacher"))


def setup_from_config(config: dict[str, Any], gpus: int | None = None, gpu_memory_gib: float | None = None) -> Setup:
    """A :class:`Setup` from what ``kdlab fit`` parsed (its namespace as a dict: ``trainer``, ``model``), on
    ``gpus`` GPUs (default: ``trainer.devices x trainer.num_nodes``) of ``gpu_memory_gib`` (default 80): a
    DistillModule here, an SFTModule or GRPOModule by :func:`~kdlab.study.setups.sft_setup` / ``grpo_setup``."""
    notes: list[str] = []
    model, trainer = dict(config.get("model") or {}), dict(config.get("trainer") or {})
    if "class_path" in model:
        stage = str(model["class_path"]).rsplit(".", 1)[-1]
        readers = {"SFTModule": sft_setup, "GRPOModule": grpo_setup}
        if stage in readers:
            return readers[stage](dict(model.get("init_args") or {}), trainer, gpus, gpu_memory_gib)
        if stage != "DistillModule":
            raise ValueError(f"model.class_path {model['class_path']!r}: kdlab estimate models DistillModule, SFTModule and GRPOModule configs")
        model = dict(model.get("init_args") or {})
    student = _spec(model.get("student"))
    teachers, cached = teacher_models(model)
    teacher = teachers[0] if teachers else None
    if student is None:
        raise ValueError("model.student: missing")
    settings = machine(trainer, {}, notes, gpus, gpu_memory_gib)
    kind, precision = settings["strategy"], settings.pop("precision")
    dtypes = {"student": student.dtype, "teacher": teacher.dtype if teacher is not None else "bfloat16"}
    if precision in ("bf16-true", "16-true"):
        dtypes = dict.fromkeys(dtypes, "bfloat16" if precision.startswith("bf16") else "float16")
        notes.append(f"trainer.precision {precision}: both models held in 16 bits")
    accumulate = settings["accumulate"]
    group = model.get("rollout_micro_batches") or accumulate
    rollout, rollout_args = _name(model.get("rollout") or "TeacherRollouts")
    lam = float(rollout_args.get("lam", 0.0))
    decoding = {"TeacherRollouts": () if rollout_args.get("dataset") else ("teacher",), "StudentRollouts": ("student",),
                "TeacherDatasetRollouts": (), "CachedTeacherRollouts": (), "VLLMRollouts": (),
                "MixtureRollouts": {1.0: ("student",), -1.0: ("teacher",)}.get(lam, ("student", "teacher"))}
    if rollout not in decoding:
        notes.append(f"rollout {rollout!r}: counted as decoding both models")
    decoders = decoding.get(rollout, ("student", "teacher"))
    objective, objective_args = _name(model.get("objective") or "ForwardKL")
    fused = model.get("fused_lm_head")
    setup = Setup(
        **settings, student=model_shape(student, "student"), teacher=model_shape(teacher, "teacher") if teacher is not None else None,
        student_dtype=dtypes["student"], teacher_dtype=dtypes["teacher"], checkpointing=bool(student.gradient_checkpointing),
        decoders=decoders, cached_teacher=cached, other_teachers=tuple(model_shape(spec, "teacher") for spec in teachers[1:]),
        objective=objective, chunk_size=int(objective_args.get("chunk_size") or 256), batch_size=int(model.get("batch_size") or 1),
        decode_group=int(group), prompt_tokens=int(model.get("max_prompt_tokens") or 2048),
        completion_tokens=int(model.get("max_completion_tokens") or 512), row_tokens=int(model.get("max_tokens_per_row") or 0),
        val_prompts=int(model.get("val_batch_size") or 8) * int(model.get("eval_samples") or 1),
        teacher_sharded=kind in ("fsdp2", "fsdp1") and model.get("teacher_placement") == "shard" and teacher is not None,
        student_fused=fused is not False and kind != "fsdp1", teacher_fused=fused is not False and kind != "fsdp1",
        served=_name(model.get("teacher"))[0] == "Served" or bool(model.get("served_teacher")),
        lora_rank=_lora(model.get("lora")), notes=notes,
    )
    if rollout == "VLLMRollouts":
        setup.vllm_fraction, setup.engine = _vllm_fraction(setup, rollout_args), str(rollout_args.get("model") or "student")
    return setup


def _vllm_fraction(setup: Setup, args: dict[str, Any]) -> float:
    """``gpu_memory_utilization`` as set, else what :func:`~kdlab.rollouts.vllm.engine_memory_fraction` sizes."""
    if args.get("gpu_memory_utilization") is not None:
        return float(args["gpu_memory_utilization"])
    from types import SimpleNamespace

    from kdlab.rollouts.vllm import engine_memory_fraction

    shape = setup.teacher if args.get("model") == "teacher" and setup.teacher is not None else setup.student
    config = SimpleNamespace(hidden_size=shape.hidden, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                             head_dim=shape.head_dim, intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied,
                             vocab_size=shape.vocab, num_hidden_layers=shape.layers, max_position_embeddings=shape.context)
    prompts = setup.batch_size * setup.decode_group
    return engine_memory_fraction(config, str(args.get("dtype") or "bfloat16"), prompts, setup.prompt_tokens + setup.completion_tokens,
                                  setup.gpu_memory, args.get("max_model_len"))


def warn_if_it_cannot_fit(config: Any) -> Estimate | None:
    """Before ``kdlab fit`` loads weights: on a GPU run (``trainer.accelerator`` gpu/cuda, or auto with CUDA)
    of a DistillModule, estimate it on the configured device count and this machine's GPU memory (80 GiB
    without CUDA) and warn (``UserWarning``) when it does not fit, naming the largest term. Never raises: an
    estimate that cannot be made says nothing."""
    import warnings

    try:
        import torch

        config = config.as_dict() if hasattr(config, "as_dict") else dict(config)
        accelerator = _name((config.get("trainer") or {}).get("accelerator") or "auto")[0].lower()
        cuda = torch.cuda.is_available()
        if accelerator not in ("gpu", "cuda") and not (accelerator == "auto" and cuda):
            return None
        memory = torch.cuda.get_device_properties(0).total_memory / GiB if cuda else None
        result = estimate(setup_from_config(config, gpu_memory_gib=memory))
    except Exception:  # noqa: BLE001 - the estimate is advice; the fit reports real problems itself
        return None
    if not result.fits:
        largest = result.largest
        warnings.warn(
            f"kdlab estimate: this run needs about {result.total / GiB:.2f} GiB per GPU, more than "
            f"{f'this GPU has ({memory:.1f} GiB)' if memory else 'an 80 GiB GPU has (no CUDA device here to ask)'}; "
            f"the largest term is {largest.key} ({largest.bytes / GiB:.2f} GiB: {largest.formula}). "
            "`kdlab estimate` with the same arguments prints every term.", UserWarning, stacklevel=2)
    return result
