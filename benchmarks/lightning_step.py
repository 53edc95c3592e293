"""The paper presets' distillation step timed through Lightning (``Trainer.fit`` of a ``DistillModule``), at a
benchmark's model shapes: what ``benchmarks/gpu.py``'s ``step`` and ``fsdp`` sections run, and, as a script, the
2-process FSDP2 run (Lightning launches the second rank by running this file again).

    python benchmarks/lightning_step.py --student DIR --teacher DIR --devices 2 --strategy fsdp2 --batch 8 \\
        --prompt-tokens 64 --completion-tokens 512 --micro-batches 2 --lengths smollm2 --out FILE

Settings are read from the paper preset (:data:`PRESET`, the countdown3 Qwen2.5-1.5B-from-7B base): the trainer's
``precision`` (``bf16-mixed``: fp32 student master weights under bf16 autocast) and ``gradient_clip_val``, the
module's temperatures, learning rate, warm-up and AdamW settings, the student in its dtype with activation
checkpointing and the teacher in its dtype, ``TeacherRollouts`` and ``ForwardKL``. Scaled to the benchmark: the
batch, the prompt and completion lengths, and ``max_tokens_per_row`` (the preset's rule: longest prompt +
longest completion) for the packed variant. TF32 is whatever the caller set (``gpu.py`` turns it on first, as
``kdlab fit`` does on CUDA).

What is timed: micro-batches of fixed completions (no decoding; the variants differ only in the layout or head),
built by ``benchmarks/packing.py``'s :func:`micro_batches` (real Countdown-3 prompts; completion lengths of a
realistic spread), one optimiser step each (``accumulate_grad_batches`` 1); the first ``warm-up`` steps are not
timed; each step's time runs from Lightning's ``on_train_batch_start`` to ``on_train_batch_end`` with CUDA
synchronised at both ends (forward, loss, backward, clipping, AdamW, logging).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from common import vocab_tokenizer  # noqa: E402
from packing import TARGET_SHARE, micro_batches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments/paper/countdown3/base-qwen1.5b_from_qwen7b.yaml"
WARMUP_PASSES = 1
"""Untimed passes over every micro-batch before the timed ones. Each micro-batch has its own shape, and a shape's
first step pays one-off costs (allocator growth, kernel selection). With one warm-up step, the H200's first run
(``benchmarks/results/gpu-nvidia-h200-fsdp-overlap.json``) timed three first-seen shapes: the one micro-batch the
warm-up had run was by far the fastest, the others' times did not follow their lengths, and ``step_s[i]`` was
micro-batch ``i + 1``'s (``i`` since ``WARMUP_PASSES``)."""


def preset_settings(path: Path = PRESET) -> dict:
    """The preset's trainer precision and clipping, and the module settings a step depends on."""
    config = yaml.safe_load(path.read_text())
    model, trainer = config["model"], config["trainer"]
    settings = {"precision": trainer["precision"], "gradient_clip_val": trainer["gradient_clip_val"],
                "student_dtype": model["student"]["dtype"], "gradient_checkpointing": model["student"]["gradient_checkpointing"],
                "teacher_dtype": model["teacher"]["dtype"], "rollout": model["rollout"]["class_path"], "objective": model["objective"]["class_path"]}
    for key in ("teacher_temperature", "student_temperature", "lr", "warmup_steps"):
        settings[key] = model[key]
    if settings["precision"] != "bf16-mixed" or settings["student_dtype"] != "float32":
        raise SystemExit(f"{path}: expected the paper's bf16-mixed precision with an fp32 student, got {settings}")
    return settings


def write_pair(student: torch.nn.Module, teacher: torch.nn.Module, vocab: int, folder: Path) -> tuple[str, str]:
    """Save two models (any dtype) with one tokenizer of exactly ``vocab`` tokens (the shared vocabulary, so the
    objectives get ``vocab`` columns); returns the student's and the teacher's folders."""
    tokenizer = vocab_tokenizer(vocab, folder / "tokenizer")
    paths = []
    for role, model in (("student", student), ("teacher", teacher)):
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(folder / role)
        tokenizer.save_pretrained(folder / role)
        paths.append(str(folder / role))
    return paths[0], paths[1]


def paper_module(student: str, teacher: str, batch: int, prompt_tokens: int, completion_tokens: int, fused: bool, packed: bool,
                 count: int, teacher_placement: str = "replicate"):
    """A ``DistillModule`` with :func:`preset_settings`, scaled to ``batch`` x (``prompt_tokens`` + ``completion_tokens``)."""
    from kdlab.models.loading import ModelSpec
    from kdlab.objectives import ForwardKL
    from kdlab.rollouts import TeacherRollouts
    from kdlab.stages.distill import DistillModule
    from kdlab.tasks import Countdown

    p = preset_settings()
    assert p["rollout"].endswith("TeacherRollouts") and p["objective"].endswith("ForwardKL"), p
    task = Countdown(variant="countdown3", instruction=False, system_prompt="", num_train=batch * 64, num_val=batch * count, num_test=0, seed=0)
    return DistillModule(
        ModelSpec(student, dtype=p["student_dtype"], gradient_checkpointing=p["gradient_checkpointing"]), ModelSpec(teacher, dtype=p["teacher_dtype"]),
        task, rollout=TeacherRollouts(), objective=ForwardKL(), teacher_temperature=p["teacher_temperature"],
        student_temperature=p["student_temperature"], max_prompt_tokens=prompt_tokens, max_completion_tokens=completion_tokens, batch_size=batch,
        lr=p["lr"], warmup_steps=p["warmup_steps"], val_examples=1, fused_lm_head=fused, seed=0, teacher_placement=teacher_placement,
        max_tokens_per_row=prompt_tokens + completion_tokens if packed else None,
    ), task


class SyncedTimer(pl.Callback):
    """Each training batch's seconds (CUDA synchronised at both ends), rows, and the student's parameter dtypes; on
    CUDA also the peak memory of each batch (``peaks``) and of its forward and backward alone, read before the
    optimiser step (``peaks_before_optimizer``): the step's own peak is AdamW's (the same for every head), the
    one before it is where the fused head and the logits path differ."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.rows: list[int] = []
        self.dtypes: set[str] = set()
        self.peaks: list[int] = []
        self.peaks_before_optimizer: list[int] = []

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._start = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if pl_module.device.type == "cuda":
            self.peaks_before_optimizer.append(torch.cuda.max_memory_allocated(pl_module.device))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sync(pl_module)
        self.times.append(time.perf_counter() - self._start)
        if pl_module.device.type == "cuda":
            self.peaks.append(torch.cuda.max_memory_allocated(pl_module.device))
        self.rows.append(len(batch))
        self.dtypes |= {str(p.dtype).removeprefix("torch.") for p in pl_module.student.parameters()}


def top_self_time(events, field: str, top: int = 15) -> list[dict]:
    """The ``top`` ops of a profiler's ``key_averages()`` with the most ``field`` (``self_device_time_total`` or
    ``self_cpu_time_total``), the longest first: name, self ms, calls."""
    rows = sorted(events, key=lambda e: getattr(e, field), reverse=True)[:top]
    return [{"op": e.key, "self_ms": getattr(e, field) / 1e3, "calls": e.count} for e in rows]


class StepProfile(pl.Callback):
    """``torch.profiler`` over the fit's last training batch (untimed: the profiler slows it): the ops with the most
    self time (device time on CUDA, CPU time elsewhere), the longest first, in ms, with their call counts."""

    def __init__(self, step: int, top: int = 15) -> None:
        self.step, self.top, self.profiler, self.ops, self.clock = step, top, None, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            cuda = pl_module.device.type == "cuda"
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.profiler is None or self.ops:
            return
        cuda = pl_module.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(pl_module.device)
        self.profiler.__exit__(None, None, None)
        field = "self_device_time_total" if cuda else "self_cpu_time_total"
        self.ops = top_self_time(self.profiler.key_averages(), field, self.top)
        self.clock = "device" if cuda else "cpu"


def on_device(rollout, device: torch.device):
    """``rollout`` with its prompt and completion tensors on ``device`` (what ``DistillModule._prompts`` does for a decode)."""
    for name in ("student_ids", "student_mask", "teacher_ids", "teacher_mask"):
        setattr(rollout.prompts, name, getattr(rollout.prompts, name).to(device))
    rollout.completion_ids, rollout.completion_mask = rollout.completion_ids.to(device), rollout.completion_mask.to(device)
    return rollout


def time_fit(student: str, teacher: str, *, batch: int, prompt_tokens: int, completion_tokens: int, lengths: str, count: int, repeats: int,
             fused: bool, packed: bool, accelerator: str, root: str, devices: int = 1, strategy: str = "auto",
             teacher_placement: str = "replicate") -> dict:
    """``Trainer.fit`` over ``count`` fixed micro-batches ``repeats`` times after :data:`WARMUP_PASSES` untimed passes over
    them (micro-batch ``i`` is step ``i`` of every pass); the shapes it
    ran (checked: ``batch`` rows a step, the student in fp32 master weights, ``B x (P + C)`` padded or rows of at most
    ``max_tokens_per_row`` packed, real tokens equal both ways) and its real tokens per second."""
    p = preset_settings()
    module, task = paper_module(student, teacher, batch, prompt_tokens, completion_tokens, fused, packed, count, teacher_placement)
    module.log = lambda *args, **kwargs: None  # no logger: the step's logging calls cost nothing extra here
    rollouts = micro_batches(module, task, lengths, batch, count, completion_tokens)
    real = [int(r.model_inputs("student")["attention_mask"].sum()) for r in rollouts]
    shapes = [list(r.model_inputs("student")["input_ids"].shape) for r in rollouts]
    if packed:
        shapes = [list(module.layout.pack(r, "student").shape) for r in rollouts]
        if any(module.layout.pack(r, "student").real_tokens() != n for r, n in zip(rollouts, real)):
            raise RuntimeError("packed rows do not hold exactly the padded micro-batch's real tokens")
        if max(shape[1] for shape in shapes) > prompt_tokens + completion_tokens:
            raise RuntimeError(f"a packed row is longer than max_tokens_per_row = {prompt_tokens + completion_tokens}: {shapes}")
    elif any(shape[0] != batch for shape in shapes):
        raise RuntimeError(f"padded micro-batches of shapes {shapes}, not {batch} rows")
    steps = count * (WARMUP_PASSES + repeats) + 1  # the last, untimed, under the profiler
    served = iter(range(steps))
    module.make_rollout = lambda examples, seed, policy=None: on_device(rollouts[next(served) % count], module.device)
    timer, profile = SyncedTimer(), StepProfile(steps - 1)
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, precision=p["precision"], max_steps=steps,
                         gradient_clip_val=p["gradient_clip_val"], accumulate_grad_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer, profile],
                         default_root_dir=root)
    trainer.fit(module)
    timed = timer.times[count * WARMUP_PASSES : count * (WARMUP_PASSES + repeats)]
    if len(timed) != count * repeats or set(timer.rows) != {batch}:
        raise RuntimeError(f"timed {len(timed)} steps of {sorted(set(timer.rows))} rows, not {count * repeats} of {batch}")
    if timer.dtypes != {"float32"}:
        raise RuntimeError(f"the student's parameters are {sorted(timer.dtypes)}, not float32 master weights under {p['precision']}")
    per_batch = [statistics.median(timed[i::count]) for i in range(count)]  # micro-batch i's median over repeats
    seconds = sum(per_batch)
    world = trainer.world_size
    record = {"fused_lm_head": fused, "layout": "packed" if packed else "padded", "precision": str(trainer.precision),
              "strategy": type(trainer.strategy).__name__, "world_size": world, "teacher_placement": teacher_placement, "batch_per_rank": batch, "micro_batches": count,
              "repeats": repeats, "warmup_passes": WARMUP_PASSES, "student_shapes": shapes, "real_tokens_per_rank": sum(real),
              "padded_tokens_per_rank": sum(r.model_inputs("student")["input_ids"].numel() for r in rollouts),
              "completion_tokens": sum(int(r.completion_mask.sum()) for r in rollouts), "step_s": per_batch, "seconds": seconds,
              "tokens_per_s": world * sum(real) / seconds, "student_dtypes": sorted(timer.dtypes),
              "token_columns": module.token_columns, "teacher_columns": module.teacher_columns,
              "float32_matmul_precision": torch.get_float32_matmul_precision(),
              "peak_gib": max(timer.peaks) / 2**30 if timer.peaks else None,
              "peak_gib_before_optimizer": max(timer.peaks_before_optimizer) / 2**30 if timer.peaks_before_optimizer else None,
              "profile": {"micro_batch": (steps - 1) % count, "clock": profile.clock, "top_self_time": profile.ops} if profile.ops else None}
    return record


def check_step(row: dict, batch: int, vocab: int, longest: int) -> None:
    """What a :func:`time_fit` row claims, checked before a ratio is taken from it: bf16-mixed over fp32 master
    weights, ``vocab`` columns on both sides, ``batch`` rows, padded rows of at most ``longest`` (P + C) tokens."""
    if row["precision"] != "bf16-mixed" or row["student_dtypes"] != ["float32"]:
        raise RuntimeError(f"the step ran {row['precision']} with student weights {row['student_dtypes']}, not bf16-mixed over fp32")
    if (row["token_columns"], row["teacher_columns"]) != (vocab, vocab):
        raise RuntimeError(f"the objective got {row['token_columns']} / {row['teacher_columns']} columns, not the shared vocabulary's {vocab}")
    if row["batch_per_rank"] != batch or row["real_tokens_per_rank"] <= 0:
        raise RuntimeError(f"the step ran {row['batch_per_rank']} rows a micro-batch ({row['real_tokens_per_rank']} real tokens), not {batch}")
    if row["layout"] == "padded" and any(shape[1] > longest for shape in row["student_shapes"]):
        raise RuntimeError(f"padded micro-batches of shapes {row['student_shapes']} are longer than P + C")


def packing_comparison(padded: dict, packed: dict) -> dict:
    """Issue #42's figures from the ``fused`` (padded) and ``packed`` rows of one batch: the padding ratio (padded
    tokens / real tokens of the student's forward), the speed-up, and the target (packed tokens/s >= 0.8 x padding
    ratio x padded tokens/s); refused unless both trained the same real tokens, packed rows within the budget."""
    if padded["real_tokens_per_rank"] != packed["real_tokens_per_rank"] or padded["completion_tokens"] != packed["completion_tokens"]:
        raise RuntimeError("the padded and packed variants trained different tokens")
    if (padded["layout"], packed["layout"]) != ("padded", "packed"):
        raise RuntimeError(f"compared {padded['layout']} with {packed['layout']}, not padded with packed")
    ratio = padded["padded_tokens_per_rank"] / padded["real_tokens_per_rank"]
    speedup = packed["tokens_per_s"] / padded["tokens_per_s"]
    return {"padding_ratio": ratio, "speedup": speedup, "target_share": TARGET_SHARE, "target_speedup": TARGET_SHARE * ratio,
            "meets_target": speedup >= TARGET_SHARE * ratio, "packed_rows": [shape[0] for shape in packed["student_shapes"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp2", choices=("fsdp2", "auto"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--lengths", default="smollm2", choices=("smollm2", "smoke"))
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.accelerator == "gpu" and torch.get_float32_matmul_precision() == "highest":
        torch.set_float32_matmul_precision("high")  # TF32, as kdlab fit sets it on CUDA
    record = time_fit(args.student, args.teacher, batch=args.batch, prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens,
                      lengths=args.lengths, count=args.micro_batches, repeats=args.repeats, fused=True, packed=args.packed,
                      accelerator=args.accelerator, root=str(args.out.parent), devices=args.devices, strategy=args.strategy,
                      teacher_placement="shard" if args.strategy == "fsdp2" else "replicate")
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
