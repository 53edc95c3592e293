"""GPU figures for issue #26 ("Scale"), one run of under 10 minutes on one CUDA GPU, written as JSON:

    python benchmarks/gpu.py [--repeats 1] [--skip decode step fsdp vllm overlap] [--out FILE]
    python benchmarks/gpu.py --smoke [--fit]  # every section at toy sizes on whatever device is present (CPU in CI)

Models: random-initialised Qwen2 models with the shapes of Qwen2.5-1.5B-Instruct (student) and
Qwen2.5-7B-Instruct (teacher), V = 151,936 / 152,064 embedding rows, built from ``Qwen2Config`` on the
device (nothing downloaded); the shared vocabulary is the tokenizer's 151,665 tokens, as kdlab cuts it.

1. ``decode``: tokens/s of kdlab's decoder (``IncrementalLM`` + ``sample_tokens``, what every rollout
   policy runs) and of HF ``generate`` side by side, both in bf16, sampling at temperature 1, on the same
   left-padded random prompts (lengths 64 to 128), at batch 1, 8 and 32, 128 new tokens each (no end token:
   both sides must return ``(B, 128)``), for the 1.5B and the 7B model; interleaved, median of
   ``--repeats`` (``benchmarks/decode.py``'s :func:`compare`, which the CPU run on SmolLM2 also uses).
2. ``step``: the paper preset's distillation step through Lightning (``benchmarks/lightning_step.py``): a
   ``Trainer`` with the preset's ``precision`` (``bf16-mixed``: fp32 student master weights with activation
   checkpointing under bf16 autocast, the teacher in bf16) and clipping, TF32 on, a ``DistillModule`` with the
   preset's temperatures, learning rate, warm-up, ``TeacherRollouts`` and ``ForwardKL``, scaled to these models:
   B = 4 completions a micro-batch (the preset's), Countdown-3 prompts (up to 64 tokens) and completions of
   ``benchmarks/packing.py``'s realistic spread up to 512 tokens (fixed: no decoding), 4 micro-batches, one
   optimiser step each, after an untimed warm-up pass over every micro-batch. Variants, in this order: ``fused``
   (the fused head), ``logits``, ``fused_again`` (the fused head after the logits path: the order's effect alone), and
   ``packed`` (the fused head on padding-free rows, ``max_tokens_per_row`` = P + C as the presets set it);
   real tokens per second, each micro-batch's median seconds, peak CUDA memory; checked before the ratio: the
   precision, fp32 master weights, B rows, ``B x (P + C)`` padded shapes, packed rows within the budget holding
   exactly the real tokens, the same real tokens every way. ``packing``: issue #42's padded vs packed figures
   (padding ratio, speed-up, its target 0.8 x padding ratio).
3. ``fsdp``: the ``fused`` step under FSDP2 (Lightning's ``ModelParallelStrategy``, ``teacher_placement: shard``
   as the ``8gpu_fsdp2`` presets): (a) in this process over a world of one (nothing is split: FSDP2's own
   overhead against section 2); (b) 2 processes (``lightning_step.py``, Lightning starts the second rank) when 2
   GPUs exist, else recorded as skipped: real tokens/s over both ranks, checked to be a world of 2.
4. ``vllm`` (when ``import vllm`` works and CUDA is present; otherwise recorded as skipped with the
   reason): a vLLM engine (bf16, CUDA graphs: ``enforce_eager`` False) on the 1.5B-shape model written to a
   temporary folder, built by ``kdlab.rollouts.VLLMRollouts``; the seconds of a weight push of the student
   (``push_weights``, median of 3) and the engine's tokens/s at batch 32 x 128 tokens beside kdlab's decoder on
   the same bf16 model, prompts, batch and length (``vllm_over_kdlab``); then 5 on-policy steps of the
   tiny-world quickstart with ``VLLMRollouts`` (push every step): whether it finished, and the mean
   ``train/importance_weight`` and ``train/engine_kl`` it logged (near 1 and 0 when pushes work).
5. ``overlap``: issue #42's wall time per on-policy step, synchronous against overlapped
   (``OverlappedRollouts(ServedRollouts, max_lag=1)``), ``benchmarks/overlap.py``'s :func:`measure`: the packaged
   tiny pair through ``Trainer.fit`` on 4 CPU threads, the loopback sampler in its own process (B = 8, 64
   tokens, 6 steps, ``--repeats`` fits per variant): on the GPU machine's cores the sampler and the trainer do
   not share two cores as they do on the CPU machine. Its checks (B rows, threads, fp32 weights, logged lags)
   must pass before the ratio is kept.

Time on an H200 at ``--repeats 1``, measured by the first run (``benchmarks/results/gpu-nvidia-h200.json`` and
``gpu-nvidia-h200-fsdp-overlap.json``, each section's seconds in the file): building both models ~1 s; decode 367 s,
not the ~90 s once estimated here (each side's warm-up run: kdlab's compiled its step per batch size and model,
133 s in all, since changed to at most three compilations per model; ``generate``'s 68 s); writing both models ~28 s; each
step variant ~35-45 s (loading both models, then the steps); fsdp (a) ~24 s; overlap ~15 s; vllm (not installed
there) est. ~235 s. That first run did not fit 10 minutes. Until one does, split it over two calls:
``--skip step fsdp vllm overlap``, then ``--skip decode``.

On CUDA the run sets ``torch.set_float32_matmul_precision("high")`` (TF32) first, as ``kdlab fit`` does, and records
it. The toy shapes of ``--smoke`` have head_dim 64, which every vLLM attention back end accepts.

Each section records its figures, or the error it met, and the script goes on, so one run on a lent GPU
reports everything. Without CUDA (and without ``--smoke``) it says so and measures nothing. ``--smoke``
runs every section at toy sizes (2-layer models, 4 new tokens, 16 completion tokens; overlap at B = 2, 8
tokens, 3 steps) on the device that is present (about 40 s on one CPU thread of a busy 2-core machine), without the ``kdlab fit``
subprocesses of sections 3 and 4 unless ``--fit`` is given (on the CPU section 3's then runs FSDP2 over 2 CPU
processes with gloo, about 30 s more). Results go to ``benchmarks/results/gpu-<device>.json``
(``gpu-cpu-smoke.json`` for a CPU smoke run) unless ``--out``; the script exits 1 when a section failed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result  # noqa: E402
from decode import compare, kdlab_decode  # noqa: E402
from lightning_step import PRESET, check_step, packing_comparison, preset_settings, time_fit, top_self_time, write_pair  # noqa: E402

from kdlab.study.estimate import PUBLISHED  # noqa: E402  (the paper models' published config numbers)


def qwen2_shape(name: str) -> dict[str, int]:
    """``Qwen2Config`` sizes of one of :data:`kdlab.study.estimate.PUBLISHED`'s models (random weights)."""
    shape = PUBLISHED[name]
    return dict(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab)


QWEN_1_5B = qwen2_shape("Qwen/Qwen2.5-1.5B-Instruct")
QWEN_7B = qwen2_shape("Qwen/Qwen2.5-7B-Instruct")
VOCAB = 151665  # the shared tokenizer's size: logits beyond it are dropped, as kdlab does
# head_dim 64 (hidden / heads), the smallest every vLLM attention back end builds (the toy shapes run on a GPU too)
TOY_STUDENT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=1000)
TOY_TEACHER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
TOY_VOCAB = 990
ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("decode", "step", "fsdp", "vllm", "overlap")
SMOKE_FIT = "--smoke without --fit: no kdlab fit subprocess (tests/test_distributed.py runs FSDP2 with a sharded teacher over 2 gloo processes)"


class Settings:
    """Sizes of one run: the real ones, or the toy ones of ``--smoke``."""

    def __init__(self, smoke: bool, repeats: int, device: str) -> None:
        self.smoke, self.repeats, self.device = smoke, repeats, device
        self.student_shape = TOY_STUDENT if smoke else QWEN_1_5B
        self.teacher_shape = TOY_TEACHER if smoke else QWEN_7B
        self.vocab = TOY_VOCAB if smoke else VOCAB
        self.decode_batches = (1, 8, 32)
        self.profile_batch = 8  # one more kdlab decode at this batch runs under torch.profiler (profile_decode)
        self.new_tokens = 4 if smoke else 128
        self.prompt_tokens = 8 if smoke else 128
        self.step_batches = (4,) if not smoke else (2,)  # the paper presets' micro-batch: 4 completions
        self.step_micro_batches = 2 if smoke else 4
        self.completion_tokens = 16 if smoke else 512
        self.step_prompt_tokens = 64  # Countdown-3 prompts fit in 64 tokens
        self.lengths = "smoke" if smoke else "smollm2"  # benchmarks/packing.py's completion lengths
        self.fit_steps = 3 if smoke else 20


def build(shape: dict, dtype: torch.dtype, device: str, checkpointing: bool = False, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False)).to(dtype)
    if checkpointing:
        from kdlab.models.loading import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    return model


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def random_prompts(batch: int, length: int, vocab: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, length)`` left-padded random prompts of lengths ``length // 2 .. length`` (row 0 the longest)."""
    from kdlab.data import left_pad

    generator = torch.Generator().manual_seed(seed)
    lengths = [length] + torch.randint(length // 2, length + 1, (batch - 1,), generator=generator).tolist()
    rows = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    ids, mask = left_pad(rows, 0)
    return ids.to(device), mask.to(device)


# ---- 1. decode ------------------------------------------------------------------------------------
def profile_decode(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, s: Settings, top: int = 15) -> dict:
    """``torch.profiler`` over one more kdlab decode of the comparison's shapes (``s.new_tokens`` tokens: the same cache
    length, so its compiled step and CUDA graph are reused, not recorded under the profiler):
    the ops with the most self time on the host and on the device, in ms, with their calls, and the decode's wall
    seconds per token, to tell what a captured decode step spends beside the weights it streams."""
    cuda, tokens = s.device == "cuda", s.new_tokens
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync(s.device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profiler:
        kdlab_decode(model, ids, mask, tokens, 0, s.vocab, torch.Generator(device=ids.device).manual_seed(0))
        sync(s.device)
    wall = time.perf_counter() - start
    events = profiler.key_averages()
    return {"tokens": tokens, "batch": ids.shape[0], "profiled_wall_s_per_token": wall / tokens,
            "top_self_cpu": top_self_time(events, "self_cpu_time_total", top),
            "top_self_device": top_self_time(events, "self_device_time_total", top) if cuda else None}


def compile_counters() -> dict:
    """Dynamo's counts so far in this process: graphs compiled (``unique_graphs``), frames compiled, graph breaks
    (each reason's first line) and the frames resumed after one, to tell a decode step captured whole from one that
    runs in pieces with eager code between (the first H200 run's log named a resumed frame inside the model's forward)."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]), "frames": int(counters["frames"]["total"]),
            "graph_breaks": {reason.splitlines()[0][:200]: int(n) for reason, n in counters["graph_break"].items()},
            "resumed_frames": dict(counters["resumes"])}


def decode_section(s: Settings, models: dict[str, tuple[torch.nn.Module, dict]]) -> dict:
    out = {"dtype": "bfloat16", "new_tokens": s.new_tokens, "prompt_tokens": s.prompt_tokens, "repeats": s.repeats}
    for role, (model, shape) in models.items():
        dtypes = {p.dtype for p in model.parameters()}
        if dtypes != {torch.bfloat16}:
            raise RuntimeError(f"the {role} decodes in {sorted(map(str, dtypes))}, not bfloat16 as this section records")
        rows = []
        for batch in s.decode_batches:
            ids, mask = random_prompts(batch, s.prompt_tokens, s.vocab, s.device, seed=batch)
            row = compare(model, ids, mask, s.new_tokens, s.repeats, pad_token_id=0, token_columns=s.vocab)
            row["compilation"] = compile_counters()
            if batch == s.profile_batch:
                try:  # a failed profile must not lose the rows measured before it
                    row["profile"] = profile_decode(model, ids, mask, s)
                except Exception as error:  # noqa: BLE001 - recorded in the result, the section goes on
                    row["profile"] = {"error": f"{type(error).__name__}: {error}"}
            rows.append(row)
            print(f"  decode {role} B={batch}: kdlab {row['kdlab']['tokens_per_s']:.1f} tok/s, HF generate {row['hf']['tokens_per_s']:.1f} "
                  f"tok/s, ratio {row['ratio']:.3f}, greedy rows identical {row['greedy_rows_identical']}", flush=True)
        out[role] = {"shape": dict(shape), "parameters": parameters(model), "results": rows}
    return out


# ---- 2. step (and 3. fsdp): through Lightning ----------------------------------------------------
STEP_VARIANTS = {"fused": (True, False), "logits": (False, False), "fused_again": (True, False), "packed": (True, True)}
"""name: (fused_lm_head, packed), run in this order. ``fused`` runs first in its process, ``fused_again`` after ``logits``:
the first H200 run had fused (first) at 0.56x logits' tokens/s, which the order alone may explain (first-seen shapes)."""


def lightning_fit(s: Settings, paths: tuple[str, str], root: str, batch: int, fused: bool, packed: bool, **strategy) -> dict:
    """:func:`lightning_step.time_fit` at this run's sizes, on this run's device."""
    return time_fit(*paths, batch=batch, prompt_tokens=s.step_prompt_tokens, completion_tokens=s.completion_tokens, lengths=s.lengths,
                    count=s.step_micro_batches, repeats=s.repeats, fused=fused, packed=packed, root=root,
                    accelerator="gpu" if s.device == "cuda" else "cpu", **strategy)


def step_section(s: Settings, paths: tuple[str, str], root: str, progress=None) -> dict:
    """Section 2; ``progress(out)`` after each variant (so that a run stopped at its time limit keeps the variants done)."""
    out = {"preset": str(PRESET.relative_to(ROOT)), "settings": preset_settings(), "vocab": s.vocab, "prompt_tokens": s.step_prompt_tokens,
           "completion_tokens": s.completion_tokens, "lengths": s.lengths, "results": {}}
    for batch in s.step_batches:
        rows = {}
        for variant, (fused, packed) in STEP_VARIANTS.items():
            rows[variant] = lightning_fit(s, paths, root, batch, fused, packed)
            check_step(rows[variant], batch, s.vocab, s.step_prompt_tokens + s.completion_tokens)
            peak = rows[variant]["peak_gib"]
            print(f"  step B={batch} x P+C<={s.step_prompt_tokens}+{s.completion_tokens} {variant} (Lightning, bf16-mixed): "
                  f"{rows[variant]['tokens_per_s']:.0f} real tok/s" + (f", peak {peak:.1f} GiB" if peak is not None else ""), flush=True)
            free(s.device)
            out["results"][str(batch)] = rows
            if progress is not None:
                progress(out)
        if rows["fused"]["real_tokens_per_rank"] != rows["logits"]["real_tokens_per_rank"]:
            raise RuntimeError("the fused and logits variants trained different tokens")
        rows["logits_over_fused"] = rows["logits"]["seconds"] / rows["fused"]["seconds"]
        rows["logits_over_fused_again"] = rows["logits"]["seconds"] / rows["fused_again"]["seconds"]
        rows["fused_again_over_fused"] = rows["fused_again"]["seconds"] / rows["fused"]["seconds"]  # the order's effect alone
        rows["packing"] = packing_comparison(rows["fused"], rows["packed"])
        print(f"  step B={batch}: padding ratio {rows['packing']['padding_ratio']:.2f}, packed / padded tokens/s "
              f"{rows['packing']['speedup']:.2f} (issue #42's target {rows['packing']['target_speedup']:.2f})", flush=True)
        out["results"][str(batch)] = rows
    return out


# ---- 3. fsdp --------------------------------------------------------------------------------------
def destroy_process_group() -> None:
    """Undo what an in-process ``ModelParallelStrategy`` run leaves: its process group (the vllm section's engine
    builds its own) and its rendezvous variables in ``os.environ`` (a later ``Trainer`` or child would read them)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name in DISTRIBUTED_ENV:
        os.environ.pop(name, None)


def fsdp_two_processes(s: Settings, paths: tuple[str, str], root: str) -> dict:
    """The fused step under FSDP2 (``ModelParallelStrategy``, teacher sharded) over 2 processes, each a
    ``lightning_step.py`` rank (Lightning starts the second); skipped unless 2 GPUs exist (2 gloo CPU processes
    in ``--smoke --fit``)."""
    cuda = s.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU visible: FSDP2 over 2 processes needs 2"}
    out = Path(root) / "fsdp2-2.json"
    command = [sys.executable, str(ROOT / "benchmarks/lightning_step.py"), "--student", paths[0], "--teacher", paths[1],
               "--accelerator", "gpu" if cuda else "cpu", "--devices", "2", "--strategy", "fsdp2", "--batch", str(s.step_batches[-1]),
               "--prompt-tokens", str(s.step_prompt_tokens), "--completion-tokens", str(s.completion_tokens), "--micro-batches",
               str(s.step_micro_batches), "--repeats", str(s.repeats), "--lengths", s.lengths, "--out", str(out)]
    record = run_fit(command)
    if record["finished"]:
        record = {**json.loads(out.read_text()), "wall_s": record["seconds"], "finished": True}
        if record["world_size"] != 2 or record["strategy"] != "ModelParallelStrategy":
            raise RuntimeError(f"ran {record['strategy']} over {record['world_size']} processes, not FSDP2 over 2")
        check_step(record, s.step_batches[-1], s.vocab, s.step_prompt_tokens + s.completion_tokens)
    return record


def quickstart_command(devices: int, accelerator: str, precision: str, extra: list[str], steps: int, root: str) -> list[str]:
    """``kdlab fit`` of the tiny-world quickstart for ``steps`` steps with no evaluation, on ``devices``."""
    return [
        sys.executable, "-m", "kdlab.cli", "fit", "--config", str(ROOT / "experiments/tiny/quickstart.yaml"),
        f"--trainer.accelerator={accelerator}", f"--trainer.devices={devices}", f"--trainer.precision={precision}", *extra,
        f"--trainer.max_steps={steps}", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false", f"--model.batch_size={32 // devices}",
        f"--trainer.logger.init_args.save_dir={root}",
    ]


# an in-process Lightning run under ModelParallelStrategy leaves these in os.environ; a child that inherits LOCAL_RANK
# takes itself for an externally launched rank and never starts the others (it waits for them forever)
DISTRIBUTED_ENV = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_fit(command: list[str], timeout_s: float = 600.0) -> dict:
    """Run one ``kdlab fit`` (or ``lightning_step.py``) without this process's distributed environment; its wall
    time, whether it finished, and its stderr's tail if it did not."""
    start = time.perf_counter()
    env = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED_ENV}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout_s)
    record = {"seconds": time.perf_counter() - start, "finished": result.returncode == 0}
    if result.returncode:
        record["error"] = result.stderr[-2000:]
    return record


def fsdp_section(s: Settings, paths: tuple[str, str], root: str, fit: bool) -> dict:
    """(a) FSDP2 in this process over a world of one (student and teacher sharded: FSDP2's own overhead against the
    step section's ``fused``); (b) :func:`fsdp_two_processes`."""
    batch = s.step_batches[-1]
    try:
        row = lightning_fit(s, paths, root, batch, True, False, devices=1, strategy="fsdp2", teacher_placement="shard")
    finally:
        destroy_process_group()
    check_step(row, batch, s.vocab, s.step_prompt_tokens + s.completion_tokens)
    if row["strategy"] != "ModelParallelStrategy" or row["world_size"] != 1:
        raise RuntimeError(f"ran {row['strategy']} over {row['world_size']} processes, not FSDP2 over 1")
    out = {"in_process": row}
    print(f"  fsdp2 in-process (world 1, student + teacher sharded) B={batch}: {row['tokens_per_s']:.0f} real tok/s", flush=True)
    if not fit:
        out["two_processes"] = {"skipped": SMOKE_FIT}
    else:
        out["two_processes"] = fsdp_two_processes(s, paths, root)
    two = out["two_processes"]
    print(f"  fsdp2 over 2 processes: {two.get('skipped') or ('%.0f real tok/s' % two['tokens_per_s'] if two['finished'] else 'FAILED')}", flush=True)
    return out  # a run that did not finish is counted as a failed section by main()


# ---- 4. vllm --------------------------------------------------------------------------------------
def vllm_unavailable(device: str) -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as error:  # ImportError, or a vLLM that fails while importing
        return f"vllm does not import ({type(error).__name__}: {error}); pip install 'kdlab[vllm]' on a CUDA machine"
    if device != "cuda":
        return "vLLM needs CUDA"
    return None


def kdlab_same_work(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, columns: int, repeats: int) -> dict:
    """kdlab's decoder on the model vLLM serves, the same left-padded prompts and ``new_tokens`` (no end token):
    median seconds of ``repeats`` after a warm-up, checked to return ``(B, new_tokens)``."""
    from decode import kdlab_decode

    model.eval()
    times = []
    for index in range(repeats + 1):
        generator = torch.Generator(device=ids.device).manual_seed(index)
        sync(str(ids.device.type))
        start = time.perf_counter()
        tokens = kdlab_decode(model, ids, mask, new_tokens, pad_token_id=0, token_columns=columns, generator=generator)
        sync(str(ids.device.type))
        if tuple(tokens.shape) != (ids.shape[0], new_tokens):
            raise RuntimeError(f"kdlab's decoder returned {tuple(tokens.shape)}, not {(ids.shape[0], new_tokens)}")
        if index:  # the first is the warm-up
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"batch": int(ids.shape[0]), "new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": ids.shape[0] * new_tokens / seconds,
            "dtype": str(next(model.parameters()).dtype)}


def vllm_section(s: Settings, fit: bool) -> dict:
    import vllm

    from kdlab.models import ModelSpec
    from kdlab.rollouts import VLLMRollouts
    from kdlab.study.runs import read_metrics

    out: dict = {"version": getattr(vllm, "__version__", None)}
    student = build(s.student_shape, torch.bfloat16, s.device, seed=1)
    batch, new_tokens = 32, s.new_tokens
    with tempfile.TemporaryDirectory() as folder:
        student.save_pretrained(folder)
        # CUDA graphs (enforce_eager False), as the paper presets run the engine
        policy = VLLMRollouts(gpu_memory_utilization=0.3, enforce_eager=False, max_model_len=s.prompt_tokens + new_tokens + 8)
        policy.engine_args["skip_tokenizer_init"] = True  # a random model has no tokenizer; prompts are token ids
        start = time.perf_counter()
        llm = policy.engine(ModelSpec(folder, dtype="bfloat16"), seed=0)
        out["engine_start_s"] = time.perf_counter() - start
        pushes = []
        for step in range(3):
            start = time.perf_counter()
            assert policy.push_weights(student, step)
            pushes.append(time.perf_counter() - start)
        out.update({"push_s": statistics.median(pushes), "pushes_s": pushes, "pushed_parameters": parameters(student),
                    "shape": dict(s.student_shape)})
        ids, mask = random_prompts(batch, s.prompt_tokens, s.vocab, "cpu", seed=batch)
        requests = [vllm.TokensPrompt(prompt_token_ids=[t for t, m in zip(row, keep) if m]) for row, keep in zip(ids.tolist(), mask.tolist())]
        params = vllm.SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, detokenize=False)
        llm.generate(requests, params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        lengths = sorted({len(o.outputs[0].token_ids) for o in outputs})
        if lengths != [new_tokens] or len(outputs) != batch:
            raise RuntimeError(f"vLLM returned {len(outputs)} rows of lengths {lengths}, not {batch} x {new_tokens}")
        out["generate"] = {"batch": batch, "new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": batch * new_tokens / seconds, "lengths": lengths,
                           "enforce_eager": False}
        out["kdlab_same_work"] = kdlab_same_work(student, ids.to(s.device), mask.to(s.device), new_tokens, s.vocab, s.repeats)
        same = out["kdlab_same_work"]
        if (same["batch"], same["new_tokens"], same["dtype"]) != (batch, new_tokens, "torch.bfloat16"):
            raise RuntimeError(f"kdlab's side ran {same['batch']} x {same['new_tokens']} in {same['dtype']}, not vLLM's {batch} x {new_tokens} bf16")
        out["vllm_over_kdlab"] = out["generate"]["tokens_per_s"] / same["tokens_per_s"]
        print(f"  vllm: engine start {out['engine_start_s']:.1f} s, push {out['push_s']:.2f} s ({parameters(student) / 1e9:.2f}B parameters), "
              f"generate B={batch} x {new_tokens}: {out['generate']['tokens_per_s']:.0f} tok/s, kdlab's decoder on the same prompts "
              f"{out['kdlab_same_work']['tokens_per_s']:.0f} tok/s (vLLM / kdlab {out['vllm_over_kdlab']:.2f})", flush=True)
    del llm, policy, student
    free(s.device)
    if not fit:
        out["fit"] = {"skipped": SMOKE_FIT}
        return out
    with tempfile.TemporaryDirectory() as root:
        command = quickstart_command(1, "gpu", "32-true", [], 5, root) + [
            "--trainer.log_every_n_steps=1", "--model.rollout=kdlab.rollouts.VLLMRollouts",
            "--model.rollout.sync_every=1", "--model.rollout.gpu_memory_utilization=0.3", "--model.rollout.dtype=bfloat16",
        ]
        fit = run_fit(command)
        for name in ("train/importance_weight", "train/engine_kl"):  # the KL, not the weight, exposes a stale engine
            values = [value for run in Path(root).rglob("version_*") for _, value in read_metrics(run).get(name, [])]
            fit[name] = statistics.mean(values) if values else None
    out["fit"] = fit
    print(f"  vllm: 5 on-policy quickstart steps with VLLMRollouts: {'ok' if fit['finished'] else 'FAILED'}, "
          f"importance weight {fit['train/importance_weight']}, engine KL {fit['train/engine_kl']}", flush=True)
    return out


# ---- 5. overlap ------------------------------------------------------------------------------------
def overlap_section(s: Settings) -> dict:
    """``benchmarks/overlap.py``'s :func:`measure`: wall time per on-policy step, synchronous against overlapped
    (``OverlappedRollouts(ServedRollouts, max_lag=1)``), the loopback sampler in its own process; its checks (B rows
    a step, threads, fp32 student, the logged lags 0 / 0 then 1) must pass before its ratio is kept."""
    import overlap

    args = argparse.Namespace(batch=2 if s.smoke else 8, tokens=8 if s.smoke else 64, steps=3 if s.smoke else 6, repeats=s.repeats,
                              threads=1 if s.smoke else 4, smoke=s.smoke)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        payload = overlap.measure(args)
    finally:
        torch.set_num_threads(threads)
    if payload["problems"]:
        raise RuntimeError("overlap measured something other than it claims: " + "; ".join(payload["problems"]))
    print(f"  overlap (tiny pair on {args.threads} CPU threads, loopback sampler in its own process, B={args.batch} x {args.tokens} tokens): "
          f"overlapped / synchronous step time {payload['ratio']:.3f}", flush=True)
    return payload


# ---- main -----------------------------------------------------------------------------------------
def device_name(device: str, smoke: bool) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ("-smoke" if smoke else "")


def run_section(record: dict, name: str, fn, save=None) -> None:
    """Run one section into ``record["sections"][name]``: its figures and seconds, or the error it met; then
    ``save()`` (the result file so far, so that a run stopped at a time limit keeps its finished sections)."""
    print(f"{name}:", flush=True)
    start = time.perf_counter()
    try:
        result = fn()
    except Exception:  # record and go on: one run on a lent GPU should report every section
        result = {"failed": traceback.format_exc()[-3000:]}
        print(f"  FAILED\n{result['failed']}", flush=True)
    result["seconds"] = time.perf_counter() - start
    record["sections"][name] = result
    if save is not None:
        save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, on whatever device is present (the CPU without CUDA)")
    parser.add_argument("--fit", action="store_true", help="with --smoke: also run the kdlab fit subprocesses of fsdp and vllm (default without --smoke)")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/gpu-<device>.json)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device: nothing measured (this script is for a GPU machine; --smoke runs it at toy sizes on the CPU)")
        return
    device = "cuda" if cuda else "cpu"
    if cuda and torch.get_float32_matmul_precision() == "highest":
        torch.set_float32_matmul_precision("high")  # TF32, as kdlab fit sets it on CUDA (the paper presets' fp32 student)
    s = Settings(args.smoke, args.repeats, device)
    fit = args.fit or not args.smoke
    started = time.perf_counter()
    record: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "smoke": args.smoke, "threads": torch.get_num_threads(),
                    "float32_matmul_precision": torch.get_float32_matmul_precision(),
                    "repeats": args.repeats, "vocab": s.vocab, "sections": {}}
    for name in args.skip:
        record["sections"][name] = {"skipped": "--skip"}
    result_name = f"gpu-{device_name(device, args.smoke)}"

    def save() -> None:
        write_result(result_name, {**record, "complete": False}, ("vllm",), args.out)

    def progress(name: str):
        """Keep a section's figures so far in the result file (marked unfinished) while it runs."""
        def keep(out: dict) -> None:
            record["sections"][name] = {**out, "unfinished": True}
            save()
        return keep

    print(f"{'toy' if args.smoke else 'Qwen2.5-1.5B / 7B'} shapes on {record['device']}", flush=True)
    teacher = build(s.teacher_shape, torch.bfloat16, device, seed=2).eval().requires_grad_(False)
    student = build(s.student_shape, torch.float32, device, checkpointing=True, seed=1)
    record["build_s"] = time.perf_counter() - started
    if "decode" not in args.skip:
        def decode():
            copy_ = copy.deepcopy(student).to(torch.bfloat16)  # decode in bf16 on both sides (kdlab and HF)
            try:
                return decode_section(s, {"student": (copy_, s.student_shape), "teacher": (teacher, s.teacher_shape)})
            finally:
                del copy_
                free(device)
        run_section(record, "decode", decode, save)
    with tempfile.TemporaryDirectory() as root:
        if {"step", "fsdp"} - set(args.skip):
            start = time.perf_counter()
            paths = write_pair(student, teacher, s.vocab, Path(root) / "models")
            record["write_models_s"] = time.perf_counter() - start
        del student, teacher
        free(device)
        if "step" not in args.skip:
            run_section(record, "step", lambda: step_section(s, paths, root, progress("step")), save)
        if "fsdp" not in args.skip:
            run_section(record, "fsdp", lambda: fsdp_section(s, paths, root, fit), save)
    if "vllm" not in args.skip:
        reason = vllm_unavailable(device)
        if reason:
            record["sections"]["vllm"] = {"skipped": reason}
            print(f"vllm: skipped ({reason})", flush=True)
        else:
            run_section(record, "vllm", lambda: vllm_section(s, fit), save)
    if "overlap" not in args.skip:
        run_section(record, "overlap", lambda: overlap_section(s), save)
    record["total_s"] = time.perf_counter() - started
    failed = [name for name, section in record["sections"].items()
              if "failed" in section or any(part.get("finished") is False for part in section.values() if isinstance(part, dict))]
    record["failed"] = failed
    record["complete"] = True
    path = write_result(result_name, record, ("vllm",), args.out)
    print(f"wrote {path} in {record['total_s']:.0f} s")
    print(f"sections failed: {failed or 'none'}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
