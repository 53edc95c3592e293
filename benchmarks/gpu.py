"""GPU figures for issue #26 ("Scale"), one run of under 10 minutes on one CUDA GPU, written as JSON:

    python benchmarks/gpu.py [--repeats 3] [--skip decode step fsdp vllm] [--out FILE]
    python benchmarks/gpu.py --smoke [--fit]  # every section at toy sizes on whatever device is present (CPU in CI)

Models: random-initialised Qwen2 models with the shapes of Qwen2.5-1.5B-Instruct (student) and
Qwen2.5-7B-Instruct (teacher), V = 151,936 / 152,064 embedding rows, built from ``Qwen2Config`` on the
device (nothing downloaded); the shared vocabulary is the tokenizer's 151,665 tokens, as kdlab cuts it.

1. ``decode``: tokens/s of kdlab's decoder (``IncrementalLM`` + ``sample_tokens``, what every rollout
   policy runs) and of HF ``generate`` side by side, both in bf16, sampling at temperature 1, on the same
   left-padded random prompts (lengths 64 to 128), at batch 1, 8 and 32, 128 new tokens each (no end token:
   both sides must return ``(B, 128)``), for the 1.5B and the 7B model; interleaved, median of
   ``--repeats`` (``benchmarks/decode.py``'s :func:`compare`, which the CPU run on SmolLM2 also uses).
2. ``step``: the paper pair's ``bf16-mixed`` distillation step as Lightning runs it: fp32 student master
   weights (activation checkpointing) under ``torch.autocast(bfloat16)``, the teacher held in bf16,
   teacher temperature 0.5, ForwardKL, AdamW (``FiniteAdamW``), B = 1 and 8 completions x 512 tokens after a
   64-token prompt. Variants: ``fused`` (the fused head: hidden states + LM head, ``[B, T, V]`` never built),
   ``logits`` (kdlab's logits path) and ``floor`` (teacher forward + student cross-entropy forward/backward
   + AdamW, the same positions). Median seconds, tokens/s, and peak CUDA memory of each.
3. ``fsdp``: FSDP2 with a sharded teacher: (a) in this process, a process group of world size 1 on one
   device, ``kdlab.stages.sharding.shard_fsdp2`` on student *and* teacher (``teacher_placement: shard``)
   with the ``bf16-mixed`` policy, then the fused step of section 2 at B = 8: seconds and peak memory
   (with one device nothing is split: this measures FSDP2's own overhead against section 2); (b)
   ``kdlab fit`` of the tiny-world quickstart, 20 steps, under Lightning's ``ModelParallelStrategy``
   with ``--model.teacher_placement=shard`` on every visible GPU, ``bf16-mixed``: whether it finished,
   its wall time.
4. ``vllm`` (when ``import vllm`` works and CUDA is present; otherwise recorded as skipped with the
   reason): a vLLM engine (bf16, CUDA graphs: ``enforce_eager`` False) on the 1.5B-shape model written to a
   temporary folder, built by ``kdlab.rollouts.VLLMRollouts``; the seconds of a weight push of the student
   (``push_weights``, median of 3) and the engine's tokens/s at batch 32 x 128 tokens beside kdlab's decoder on
   the same bf16 model, prompts, batch and length (``vllm_over_kdlab``); then 5 on-policy steps of the
   tiny-world quickstart with ``VLLMRollouts`` (push every step): whether it finished, and the mean
   ``train/importance_weight`` and ``train/engine_kl`` it logged (near 1 and 0 when pushes work).

Time on an H200 (estimates; the run prints each section's wall time and writes it to the JSON):
building both models on the GPU ~30 s. decode: a 1.5B/7B bf16 decode step is launch-bound eager PyTorch,
~25-35 ms per token at these batches, so 2 models x 3 batches x 2 sides x (1 warm-up + 3 runs) x 128
tokens x ~30 ms ~= 190 s. step: B x 512 = 512 or 4,096 tokens, ~0.2-1 s per step, 2 batches x 3 variants x
4 steps ~= 25 s. fsdp: sharding + 4 steps ~= 15 s, plus one ``kdlab fit`` with start-up ~= 60 s. vllm: writing
the 3 GB model ~15 s, engine start with CUDA graph capture ~90 s, pushes and a generate ~10 s, kdlab's decoder
on the same work (1 warm-up + ``--repeats`` x 128 tokens x ~30 ms) ~15 s, the 5-step fit with its own engine
~120 s. Total ~= 30 + 190 + 25 + 75 + 250 ~= 570 s, under 10 minutes; ``--repeats 1`` cuts decode to about
half.

On CUDA the run sets ``torch.set_float32_matmul_precision("high")`` (TF32) first, as ``kdlab fit`` does, and records
it. The toy shapes of ``--smoke`` have head_dim 64, which every vLLM attention back end accepts.

Each section records its figures, or the error it met, and the script goes on, so one run on a lent GPU
reports everything. Without CUDA (and without ``--smoke``) it says so and measures nothing. ``--smoke``
runs every section at toy sizes (2-layer models, 4 new tokens, 16 completion tokens) on the device that is
present (11 s on one CPU thread of a quiet 2-core machine, 50 s under a load of 4), without the ``kdlab fit``
subprocesses of sections 3 and 4 unless ``--fit`` is given (on the CPU that fit runs FSDP2 over 2 CPU
processes with gloo, about a minute more). Results go to ``benchmarks/results/gpu-<device>.json``
(``gpu-cpu-smoke.json`` for a CPU smoke run) unless ``--out``; the script exits 1 when a section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import re
import socket
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
from decode import compare  # noqa: E402

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
SECTIONS = ("decode", "step", "fsdp", "vllm")
SMOKE_FIT = "--smoke without --fit: no kdlab fit subprocess (tests/test_distributed.py runs FSDP2 with a sharded teacher over 2 gloo processes)"


class Settings:
    """Sizes of one run: the real ones, or the toy ones of ``--smoke``."""

    def __init__(self, smoke: bool, repeats: int, device: str) -> None:
        self.smoke, self.repeats, self.device = smoke, repeats, device
        self.student_shape = TOY_STUDENT if smoke else QWEN_1_5B
        self.teacher_shape = TOY_TEACHER if smoke else QWEN_7B
        self.vocab = TOY_VOCAB if smoke else VOCAB
        self.decode_batches = (1, 8, 32)
        self.new_tokens = 4 if smoke else 128
        self.prompt_tokens = 8 if smoke else 128
        self.step_batches = (1, 8) if not smoke else (1, 2)
        self.completion_tokens = 16 if smoke else 512
        self.step_prompt_tokens = 8 if smoke else 64
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
def decode_section(s: Settings, models: dict[str, tuple[torch.nn.Module, dict]]) -> dict:
    out = {"dtype": "bfloat16", "new_tokens": s.new_tokens, "prompt_tokens": s.prompt_tokens, "repeats": s.repeats}
    for role, (model, shape) in models.items():
        rows = []
        for batch in s.decode_batches:
            ids, mask = random_prompts(batch, s.prompt_tokens, s.vocab, s.device, seed=batch)
            row = compare(model, ids, mask, s.new_tokens, s.repeats, pad_token_id=0, token_columns=s.vocab)
            rows.append(row)
            print(f"  decode {role} B={batch}: kdlab {row['kdlab']['tokens_per_s']:.1f} tok/s, HF generate {row['hf']['tokens_per_s']:.1f} "
                  f"tok/s, ratio {row['ratio']:.3f}, greedy rows identical {row['greedy_rows_identical']}", flush=True)
        out[role] = {"shape": dict(shape), "parameters": parameters(model), "results": rows}
    return out


# ---- 2. step --------------------------------------------------------------------------------------
def step_functions(s: Settings, student, teacher, optimizer, batch: int):
    """``{variant: one training step}`` at ``batch`` x ``completion_tokens`` under bf16 autocast."""
    from kdlab.objectives import ForwardKL
    from kdlab.objectives.logits import completion_head_logits, completion_logits

    generator = torch.Generator().manual_seed(batch)
    length = s.step_prompt_tokens + s.completion_tokens
    ids = torch.randint(0, s.vocab, (batch, length), generator=generator).to(s.device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    mask = torch.ones(batch, s.completion_tokens, dtype=torch.bool, device=s.device)
    targets = ids[:, -s.completion_tokens:]
    objective = ForwardKL()
    tokens, vocab = s.completion_tokens, s.vocab
    autocast = lambda: torch.autocast(s.device, dtype=torch.bfloat16)  # noqa: E731

    def finish_step(loss):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()

    def fused():
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            with torch.no_grad():
                t = completion_head_logits(teacher, inputs, tokens, vocab, 0.5).detach()
            loss = objective(completion_head_logits(student, inputs, tokens, vocab), t, mask)
        finish_step(loss)
        return loss, objective.take_diagnostics()

    def logits():
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            with torch.no_grad():
                t = completion_logits(teacher, inputs, tokens, vocab).div_(0.5)
            loss = objective(completion_logits(student, inputs, tokens, vocab), t, mask, consume=True)
        finish_step(loss)
        return loss, objective.take_diagnostics()

    def floor():
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            with torch.no_grad():
                completion_logits(teacher, inputs, tokens, vocab)
            student_logits = completion_logits(student, inputs, tokens, vocab)
            loss = torch.nn.functional.cross_entropy(student_logits.reshape(-1, vocab).float(), targets.reshape(-1))
        finish_step(loss)
        return loss, {}

    return {"fused": fused, "logits": logits, "floor": floor}


def timed_steps(s: Settings, step, repeats: int) -> dict:
    """Median seconds of ``repeats`` steps after a warm-up; peak memory of those steps; the first loss."""
    loss, diagnostics = step()
    sync(s.device)
    reset_peak(s.device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync(s.device)
        times.append(time.perf_counter() - start)
    return {"time_s": statistics.median(times), "times_s": times, "peak_gib": peak_gib(s.device), "first_loss": float(loss.detach()),
            "diagnostics": sorted(diagnostics)}


def step_section(s: Settings, student, teacher) -> dict:
    from kdlab.stages.optim import FiniteAdamW

    optimizer = FiniteAdamW(student.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    out = {"autocast": "bfloat16", "student_dtype": str(next(student.parameters()).dtype).removeprefix("torch."),
           "teacher_dtype": str(next(teacher.parameters()).dtype).removeprefix("torch."), "objective": "ForwardKL",
           "teacher_temperature": 0.5, "completion_tokens": s.completion_tokens, "prompt_tokens": s.step_prompt_tokens,
           "activation_checkpointing": "student", "optimizer": "FiniteAdamW", "vocab": s.vocab, "results": {}}
    for batch in s.step_batches:
        rows = {}
        for variant, step in step_functions(s, student, teacher, optimizer, batch).items():
            rows[variant] = timed_steps(s, step, s.repeats)
            rows[variant]["tokens_per_s"] = batch * s.completion_tokens / rows[variant]["time_s"]
            peak = rows[variant]["peak_gib"]
            print(f"  step B={batch} x T={s.completion_tokens} {variant}: {rows[variant]['time_s']:.3f} s"
                  + (f", peak {peak:.1f} GiB" if peak is not None else ""), flush=True)
            free(s.device)
        for variant in ("fused", "logits"):
            rows[variant]["floor_ratio"] = rows[variant]["time_s"] / rows["floor"]["time_s"]
        out["results"][str(batch)] = rows
    del optimizer
    student.zero_grad(set_to_none=True)
    free(s.device)
    return out


# ---- 3. fsdp --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def single_process_group(device: str):
    import torch.distributed as dist

    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp_in_process(s: Settings, student, teacher) -> dict:
    """Student and teacher ``fully_shard``-ed (FSDP2, ``bf16-mixed`` policy) over a world of one; the fused step."""
    from torch.distributed.device_mesh import init_device_mesh

    from kdlab.stages.optim import FiniteAdamW
    from kdlab.stages.sharding import shard_fsdp2

    batch = s.step_batches[-1]
    with single_process_group(s.device):
        mesh = init_device_mesh(s.device, (1,))
        shard_fsdp2([student, teacher], mesh, "bf16-mixed")
        sharded = [type(m).__name__ for m in (student, teacher)]
        optimizer = FiniteAdamW(student.parameters(), lr=1e-6)
        step = step_functions(s, student, teacher, optimizer, batch)["fused"]
        row = timed_steps(s, step, s.repeats)
        del optimizer
    row.update({"world_size": 1, "devices_visible": torch.cuda.device_count() if s.device == "cuda" else 0, "batch": batch,
                "completion_tokens": s.completion_tokens, "tokens_per_s": batch * s.completion_tokens / row["time_s"],
                "sharded": sharded, "policy": "bf16-mixed (bf16 gathers, fp32 gradient reduction)", "autocast": "bfloat16"})
    print(f"  fsdp2 in-process (world 1, student + teacher sharded) B={batch}: {row['time_s']:.3f} s", flush=True)
    return row


def quickstart_command(devices: int, accelerator: str, precision: str, extra: list[str], steps: int, root: str) -> list[str]:
    """``kdlab fit`` of the tiny-world quickstart for ``steps`` steps with no evaluation, on ``devices``."""
    return [
        sys.executable, "-m", "kdlab.cli", "fit", "--config", str(ROOT / "experiments/tiny/quickstart.yaml"),
        f"--trainer.accelerator={accelerator}", f"--trainer.devices={devices}", f"--trainer.precision={precision}", *extra,
        f"--trainer.max_steps={steps}", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false", f"--model.batch_size={32 // devices}",
        f"--trainer.logger.init_args.save_dir={root}",
    ]


def run_fit(command: list[str]) -> dict:
    """Run one ``kdlab fit``; its wall time, whether it finished, and its stderr's tail if it did not."""
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    record = {"seconds": time.perf_counter() - start, "finished": result.returncode == 0}
    if result.returncode:
        record["error"] = result.stderr[-2000:]
    return record


def fsdp_section(s: Settings, student, teacher, fit: bool) -> dict:
    cuda = s.device == "cuda"
    out = {"in_process": fsdp_in_process(s, student, teacher)}
    if not fit:
        out["fit"] = {"skipped": SMOKE_FIT}
        print(f"  fsdp2 kdlab fit: skipped ({SMOKE_FIT})", flush=True)
        return out
    devices = torch.cuda.device_count() if cuda else 2
    accelerator, precision = ("gpu", "bf16-mixed") if cuda else ("cpu", "32-true")
    fsdp2 = ["--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
             f"--trainer.strategy.data_parallel_size={devices}", "--trainer.strategy.tensor_parallel_size=1",
             "--model.teacher_placement=shard"]
    with tempfile.TemporaryDirectory() as root:
        fit = run_fit(quickstart_command(devices, accelerator, precision, fsdp2, s.fit_steps, root))
    fit.update({"devices": devices, "accelerator": accelerator, "precision": precision, "steps": s.fit_steps, "teacher_placement": "shard",
                "strategy": "ModelParallelStrategy (FSDP2)"})
    out["fit"] = fit
    print(f"  fsdp2 kdlab fit ({s.fit_steps} steps, {devices} {accelerator} device(s), {precision}, teacher sharded): "
          f"{fit['seconds']:.1f} s, {'ok' if fit['finished'] else 'FAILED'}", flush=True)
    return out  # a fit that did not finish is counted as a failed section by main()


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
        out["vllm_over_kdlab"] = out["generate"]["tokens_per_s"] / out["kdlab_same_work"]["tokens_per_s"]
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


# ---- main -----------------------------------------------------------------------------------------
def device_name(device: str, smoke: bool) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ("-smoke" if smoke else "")


def run_section(record: dict, name: str, fn) -> None:
    """Run one section into ``record["sections"][name]``: its figures and seconds, or the error it met."""
    print(f"{name}:", flush=True)
    start = time.perf_counter()
    try:
        result = fn()
    except Exception:  # record and go on: one run on a lent GPU should report every section
        result = {"failed": traceback.format_exc()[-3000:]}
        print(f"  FAILED\n{result['failed']}", flush=True)
    result["seconds"] = time.perf_counter() - start
    record["sections"][name] = result


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
        run_section(record, "decode", decode)
    if "step" not in args.skip:
        run_section(record, "step", lambda: step_section(s, student, teacher))
    if "fsdp" not in args.skip:
        run_section(record, "fsdp", lambda: fsdp_section(s, student, teacher, fit))  # shards the models: the last to use them
    del student, teacher
    free(device)
    if "vllm" not in args.skip:
        reason = vllm_unavailable(device)
        if reason:
            record["sections"]["vllm"] = {"skipped": reason}
            print(f"vllm: skipped ({reason})", flush=True)
        else:
            run_section(record, "vllm", lambda: vllm_section(s, fit))
    record["total_s"] = time.perf_counter() - started
    failed = [name for name, section in record["sections"].items()
              if "failed" in section or section.get("fit", {}).get("finished") is False]
    record["failed"] = failed
    path = write_result(f"gpu-{device_name(device, args.smoke)}", record, ("vllm",), args.out)
    print(f"wrote {path} in {record['total_s']:.0f} s")
    print(f"sections failed: {failed or 'none'}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
