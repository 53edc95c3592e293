"""Run by tests/test_distributed.py as its own program: Lightning re-launches it once per rank.

    python tests/distributed_worker.py OUT_DIR {single|fsdp2|fsdp1|ddp}[-fused][-bf16][-probe] [STEPS [EXAMPLES [RESUME]]]

Distils the packaged random tiny pair for STEPS (default 2) steps from a fixed teacher dataset of
EXAMPLES prompts (default 8; so rollouts are the same whatever the process layout), with a global batch
of 8 prompts, and writes the full student weights (rank 0), each rank's local parameter count and the
update-sparsity report to OUT_DIR. A checkpoint is saved after every step (``OUT_DIR/checkpoints/last``);
RESUME continues from such a checkpoint.

``-probe`` adds callbacks that write what each rank saw: ``precision-rank<r>.json`` (after one forward:
the dtypes of the rotary ``inv_freq`` buffers and each FSDP1 unit's mixed precision),
``ood-rank<r>.jsonl`` (the scores OODForgetting's lm-eval back end logged, measured by a stand-in for
lm-eval that saves the model it was given to ``ood-model-<n>.pt``) and ``coverage-rank<r>.jsonl``
(the prompts Coverage sampled on that rank, their completions and the pooled per-prompt counts).

``-accum`` takes each step in 2 micro-batches (``accumulate_grad_batches=2``, the same global batch);
``-count`` writes ``reduce_scatters-rank<r>.json``, the gradient reduce-scatters that rank issued;
``-sync`` makes every FSDP2 backward reduce its gradients (``set_requires_gradient_sync`` forced true).
``-packed`` trains on padding-free micro-batches (``max_tokens_per_row``: each rank's sequences packed into rows).
``-log`` logs every step (``log_every_n_steps=1``) and writes ``logged-rank<r>.jsonl``: every ``train/`` value that rank
passed to ``self.log``, unsynced, in order, with the optimiser steps taken before it (:class:`LogProbe`).
"""

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

import kdlab.callbacks.evaluations as evaluations
from kdlab.callbacks import Coverage, FinalCheckpoint, OODForgetting, UpdateSparsity
from kdlab.evaluation.lm_eval_suite import LMEvalTask, is_sharded
from kdlab.models import export_pretrained
from kdlab.models.export import merged_weights
from kdlab.rollouts import TeacherDatasetRollouts
from kdlab.stages import DistillModule
from kdlab.stages.lora import LoraSpec
from kdlab.teachers import Average, ModelTeacher, Several
from kdlab.tasks import Addition

GLOBAL_BATCH = 8


class CPUFSDPStrategy(FSDPStrategy):
    """Test only: Lightning refuses ``strategy: fsdp`` on the CPU (it checks for exactly this class) and
    gives FSDP1 no device on the CPU (``root_device.index`` is None), while torch's FSDP1 itself runs on
    the CPU with gloo given ``device_id=cpu``. This subclass changes only that, so the tests run kdlab's
    FSDP1 path (kdlab wraps the modules itself, so Lightning's own root wrapping never runs)."""

    @contextmanager
    def model_sharded_context(self):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                         sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs):
            yield


class Dump(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # FSDP2 parameters are DTensors (to_local: this rank's shard); FSDP1 ones are this rank's flat shards
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in pl_module.student.parameters())
        if trainer.world_size > 1 and isinstance(trainer.strategy, ModelParallelStrategy):
            state = get_model_state_dict(pl_module.student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            total = sum(p.numel() for p in pl_module.student.parameters())  # a DTensor's numel is the global one
        else:  # (an FSDP1 root's state_dict is the full one by default, gathered on every rank)
            state = {k: v.detach().cpu() for k, v in pl_module.student.state_dict().items()}
            total = sum(v.numel() for k, v in state.items() if not k.endswith("inv_freq"))
        grad_norm = float(pl_module.student_grad_norm())  # the last step's (clipped) gradient; a collective
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"local": local, "total": total, "grad_norm": grad_norm}))
        # what a weight push to vLLM and an export read: whole tensors under Hugging Face names (collectives)
        shapes = {name: list(tensor.shape) for name, tensor in merged_weights(pl_module.student)}
        export_pretrained(pl_module.student, pl_module.student_tokenizer, self.out / "export", write=trainer.is_global_zero)
        if trainer.is_global_zero:
            torch.save(state, self.out / "student.pt")
            (self.out / "merged_shapes.json").write_text(json.dumps(shapes))


class LogProbe(pl.Callback):
    """Records each ``train/`` value this rank hands to ``self.log`` (before Lightning reduces it over the ranks)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer, pl_module, stage: str) -> None:
        log, path = pl_module.log, self.out / f"logged-rank{trainer.global_rank}.jsonl"

        def recording(name, value, *args, **kwargs):
            if name.startswith("train/"):
                with path.open("a") as handle:
                    handle.write(json.dumps({"name": name, "value": float(value), "steps_before": trainer.global_step}) + "\n")
            return log(name, value, *args, **kwargs)

        pl_module.log = recording


class PrecisionProbe(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        report = {}
        for role in ("student", "teacher"):
            model = getattr(pl_module, role)
            with torch.no_grad():  # FSDP1 casts buffers to the buffer dtype in its first forward
                model(input_ids=torch.tensor([[1, 2, 3]], device=pl_module.device))
            report[f"{role}_inv_freq"] = sorted({str(b.dtype) for n, b in model.named_buffers() if n.endswith("inv_freq")})
            report[f"{role}_units"] = sorted({str((m.mixed_precision.param_dtype, m.mixed_precision.reduce_dtype, m.mixed_precision.buffer_dtype))
                                              for m in FullyShardedDataParallel.fsdp_modules(model)})
        (self.out / f"precision-rank{trainer.global_rank}.json").write_text(json.dumps(report))


class ProbeOOD(OODForgetting):
    """OODForgetting's lm-eval back end with lm-eval itself replaced (see ``stand_in_suite``)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        evaluations.import_lm_eval = lambda setting=None: None
        evaluations.validate_suite = lambda *args, **kwargs: None
        evaluations.evaluate_suite = self.stand_in_suite
        super().__init__(lm_eval_tasks={"toy": LMEvalTask("toy")})
        self.calls = 0

    def stand_in_suite(self, model, tokenizer, tasks, **settings):
        """Save the model it is given (whole weights, HF names) and score it by the sum of its weights."""
        self.calls += 1
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert not is_sharded(model) and not isinstance(model, FullyShardedDataParallel), type(model)
        state = {name: value.detach().cpu() for name, value in model.state_dict().items()}
        torch.save(state, self.out / f"ood-model-{self.calls}.pt")
        return {"toy": sum(float(value.double().sum()) for name, value in state.items() if not name.endswith("inv_freq"))}

    def lm_eval_scores(self, pl_module):
        scores = super().lm_eval_scores(pl_module)
        with (self.out / f"ood-rank{pl_module.trainer.global_rank}.jsonl").open("a") as handle:
            handle.write(json.dumps({"step": pl_module.trainer.global_step, "calls": self.calls, **scores}) + "\n")
        return scores


class ProbeCoverage(Coverage):
    def __init__(self, out: Path) -> None:
        self.out = out
        super().__init__(Addition(num_val=5, seed=3), ks=(1, 2), samples=2, examples=5, max_new_tokens=4, batch_size=4)

    def sample(self, pl_module, task, examples, role="student", repeat=1, model=None):
        texts = super().sample(pl_module, task, examples, role=role, repeat=repeat, model=model)
        self._sampled = {"ids": [ex["id"] for ex in examples], "texts": texts, "seed": self.seed}
        return texts

    def correct_counts(self, trainer, pl_module, examples):
        counts = super().correct_counts(trainer, pl_module, examples)
        with (self.out / f"coverage-rank{trainer.global_rank}.jsonl").open("a") as handle:
            handle.write(json.dumps({**self._sampled, "all_ids": [ex["id"] for ex in examples], "counts": counts}) + "\n")
        return counts


def count_reduce_scatters() -> list[int]:
    """Wrap torch.distributed's reduce-scatter entry points (FSDP2 calls ``reduce_scatter_single`` or, in older
    torch, ``reduce_scatter_tensor``); the returned one-element list counts the calls."""
    import torch.distributed as dist

    calls = [0]
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        original = getattr(dist, name, None)
        if original is not None:
            def counted(*args, _original=original, **kwargs):
                calls[0] += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
    return calls


def force_gradient_sync() -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_requires_gradient_sync
    FSDPModule.set_requires_gradient_sync = lambda self, sync, *, recurse=True: original(self, True, recurse=recurse)


def main(out: Path, layout: str, steps: int = 2, examples: int = GLOBAL_BATCH, resume: str | None = None) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    task = Addition(num_train=examples, num_val=0, num_test=0)
    data = out / "teacher.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"id": ex["id"], "completion": f"<answer>{ex['a'] * 7 ** i}</answer>"}) + "\n"
                                for i, ex in enumerate(task.examples("train"))))
    layout, *flags = layout.split("-")
    precision = "bf16-mixed" if "bf16" in flags else "32-true"
    fused = "fused" in flags  # the hidden-state + LM-head path (HeadLogits) instead of logits
    probes = [PrecisionProbe(out), ProbeOOD(out), ProbeCoverage(out)] if "probe" in flags else []
    probes += [LogProbe(out)] if "log" in flags else []
    devices = 1 if layout == "single" else 2
    accumulate = 2 if "accum" in flags else 1
    calls = count_reduce_scatters() if "count" in flags else None
    if "sync" in flags:
        force_gradient_sync()
    teacher = "kdlab://tiny-random/teacher"
    if "teachers" in flags:  # two in-process teachers averaged on every row (sharded like the student under FSDP)
        teacher = Several({"strong": ModelTeacher("kdlab://tiny-random/teacher"), "self": ModelTeacher("kdlab://tiny-random/student")},
                          Average({"strong": 3.0, "self": 1.0}))
    module = DistillModule(
        "kdlab://tiny-random/student", teacher, task,
        rollout=TeacherDatasetRollouts(str(data)), batch_size=GLOBAL_BATCH // devices // accumulate, lr=1e-3, warmup_steps=0,
        teacher_placement="shard" if layout in ("fsdp2", "fsdp1") else "replicate", fused_lm_head=fused,
        lora=LoraSpec(r=4, alpha=8) if "lora" in flags else None,  # a LoRA student: adapters sharded with the rest
        max_tokens_per_row=2560 if "packed" in flags else None,  # the smallest allowed (2048 + 512): one row per micro-batch here
    )
    strategy = {
        "single": "auto",
        "ddp": DDPStrategy(process_group_backend="gloo"),
        # tensor_parallel_size must be 1: its default "auto" would silently make this TP=2
        "fsdp2": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"),
        "fsdp1": CPUFSDPStrategy(process_group_backend="gloo", state_dict_type="sharded"),
    }[layout]
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, precision=precision,
        accumulate_grad_batches=accumulate, log_every_n_steps=1 if "log" in flags else 50,
        gradient_clip_val=0.05,  # small enough to clip, so sharded clipping is exercised too
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=str(out),
        callbacks=[
            Dump(out),
            UpdateSparsity(thresholds=(1e-6, 1e-3)),  # each rank counts its part of each whole weight, then reduced
            ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, every_n_train_steps=1),
            # one file of whole tensors, whatever the strategy's own checkpoints are; not under FSDP1 here: its full-state
            # gather (Lightning's default for FSDP1) crashes on CPU tensors with gloo, so that path is untested
            *([] if layout == "fsdp1" else [FinalCheckpoint()]),
            *probes,
        ],
    )
    trainer.fit(module, ckpt_path=resume)
    if calls is not None:
        (out / f"reduce_scatters-rank{trainer.global_rank}.json").write_text(json.dumps(calls[0]))


if __name__ == "__main__":
    arguments = sys.argv[1:] + [None] * 5
    main(Path(arguments[0]), arguments[1], int(arguments[2] or 2), int(arguments[3] or GLOBAL_BATCH), arguments[4])
