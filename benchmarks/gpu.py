"""GPU figures for the issue "Scale", written to run unchanged on one CUDA machine:

    python benchmarks/gpu.py [--tokens 1024] [--repeats 5] [--skip fsdp vllm]
    python benchmarks/gpu.py --smoke      # every section at toy sizes; runs on the CPU too (CI does)

1. ``step``: at the paper's real sizes in bf16 (random-initialised Qwen2 models with the shapes of
   Qwen2.5-1.5B-Instruct and Qwen2.5-7B-Instruct, V = 151,936 / 152,064 rows, nothing downloaded), one
   distillation step (teacher forward, student forward-backward, kdlab's chunked forward KL and the
   exact KL diagnostics) divided by teacher forward + student forward-backward with cross-entropy,
   B = 2, T = ``--tokens``; the same with ``fused_lm_head`` (hidden states + LM head); peak CUDA memory
   of each.
2. ``fsdp``: ``kdlab fit`` of the tiny-world quickstart under Lightning's ``ModelParallelStrategy``
   (FSDP2) on every visible GPU with ``bf16-mixed``, then the same under ``strategy: fsdp`` (FSDP1,
   CUDA only): seconds for the run and whether it finished.
3. ``vllm`` (needs ``pip install 'kdlab[vllm]'``): on the tiny world, greedy teacher completions from
   vLLM in bf16 against kdlab's own decoder in fp32 (how many are identical), the time of each, and a
   5-step on-policy ``kdlab fit`` with ``VLLMRollouts`` (bf16 engine, weights pushed every step):
   whether it finished, its mean ``train/importance_weight`` and its mean ``train/engine_kl`` (an
   estimate of KL(engine || student): near 0 when pushes work, up to bf16-vs-fp32 numerics).

Each section prints its measurement or the error it met and the script goes on, so one run on a lent
GPU reports everything. Without CUDA (and without ``--smoke``) it says so and measures nothing.
``--smoke`` replaces the real sizes with toy ones and, on a machine without CUDA, runs ``step`` and
``fsdp`` (FSDP2 over 2 CPU processes with gloo) on the CPU, so the script itself is known to work.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
VOCAB = 151665  # the shared tokenizer's size: logits beyond it are dropped, as kdlab does
TOY_STUDENT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=1000)
TOY_TEACHER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=1024)
TOY_VOCAB = 990
ROOT = Path(__file__).resolve().parents[1]


def build(shape: dict, dtype: torch.dtype, device: str, checkpointing: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False)).to(dtype)
    if checkpointing:
        from kdlab.models.loading import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    return model


def timed(fn, repeats: int, device: str) -> tuple[float, float | None]:
    """Median seconds over ``repeats`` runs after a warm-up, and peak CUDA memory (GiB) of the runs
    (``None`` on the CPU)."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return statistics.median(times), peak


def memory(peak: float | None) -> str:
    return f"peak {peak:.1f} GiB" if peak is not None else "peak n/a (CPU)"


def step_figures(tokens: int, repeats: int, device: str, smoke: bool) -> None:
    from kdlab.objectives.logits import completion_head_logits, completion_logits
    from kdlab.objectives import ForwardKL

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    student = build(TOY_STUDENT if smoke else QWEN_1_5B, dtype, device, checkpointing=True)
    teacher = build(TOY_TEACHER if smoke else QWEN_7B, dtype, device, checkpointing=False).eval().requires_grad_(False)
    vocab = TOY_VOCAB if smoke else VOCAB
    ids = torch.randint(0, vocab, (2, tokens + 32), device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    mask = torch.ones(2, tokens, dtype=torch.bool, device=device)
    targets = ids[:, -tokens:]
    objective = ForwardKL()

    def kdlab_step(fused: bool):
        student.zero_grad(set_to_none=True)
        with torch.no_grad():
            t = completion_head_logits(teacher, inputs, tokens, vocab, 0.5) if fused else completion_logits(teacher, inputs, tokens, vocab) / 0.5
        s = completion_head_logits(student, inputs, tokens, vocab) if fused else completion_logits(student, inputs, tokens, vocab)
        objective(s, t, mask, consume=not fused).backward()  # as DistillModule calls it
        objective.take_diagnostics()  # the exact KLs and entropies, from the same pass

    def floor_step():
        student.zero_grad(set_to_none=True)
        with torch.no_grad():
            completion_logits(teacher, inputs, tokens, vocab)
        logits = completion_logits(student, inputs, tokens, vocab)
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1)).backward()

    floor, floor_mem = timed(floor_step, repeats, device)
    plain, plain_mem = timed(lambda: kdlab_step(False), repeats, device)
    fused, fused_mem = timed(lambda: kdlab_step(True), repeats, device)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    shapes = "toy shapes" if smoke else "Qwen2.5-1.5B shape <- 7B shape"
    print(f"step ({str(dtype).removeprefix('torch.')}, {shapes}, B=2, T={tokens}, {where}):")
    print(f"  floor (teacher forward + student CE fwd/bwd): {floor:.3f} s, {memory(floor_mem)}")
    print(f"  kdlab logits path: {plain:.3f} s ({plain / floor:.3f}x, target <= 1.05), {memory(plain_mem)}")
    print(f"  kdlab fused_lm_head: {fused:.3f} s ({fused / floor:.3f}x), {memory(fused_mem)}")


def quickstart_command(devices: int, accelerator: str, precision: str, strategy: list[str], steps: int, root: str) -> list[str]:
    """``kdlab fit`` of the tiny-world quickstart for ``steps`` steps with no evaluation, on ``devices``."""
    return [
        sys.executable, "-m", "kdlab.cli", "fit", "--config", str(ROOT / "experiments/tiny/quickstart.yaml"),
        f"--trainer.accelerator={accelerator}", f"--trainer.devices={devices}", f"--trainer.precision={precision}", *strategy,
        f"--trainer.max_steps={steps}", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false", f"--model.batch_size={32 // devices}",
        f"--trainer.logger.init_args.save_dir={root}",
    ]


def run_fit(label: str, command: list[str]) -> bool:
    """Run one ``kdlab fit``; print its wall time and its stderr's tail if it failed; return whether it finished."""
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.perf_counter() - start
    status = "ok" if result.returncode == 0 else f"FAILED (exit {result.returncode}):\n{result.stderr[-2000:]}"
    print(f"{label}: {elapsed:.1f} s in all (including start-up), {status}")
    return result.returncode == 0


def fsdp_figures(device: str, smoke: bool) -> None:
    cuda = device == "cuda"
    devices = torch.cuda.device_count() if cuda else 2
    accelerator, precision = ("gpu", "bf16-mixed") if cuda else ("cpu", "32-true")
    steps = 3 if smoke else 20
    fsdp2 = ["--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
             f"--trainer.strategy.data_parallel_size={devices}", "--trainer.strategy.tensor_parallel_size=1"]
    with tempfile.TemporaryDirectory() as root:
        finished = [run_fit(f"fsdp2: tiny-world quickstart, {steps} steps, ModelParallelStrategy over {devices} {accelerator} device(s), {precision}",
                            quickstart_command(devices, accelerator, precision, fsdp2, steps, root))]
        if cuda:
            finished.append(run_fit(f"fsdp1: the same under strategy: fsdp over {devices} GPU(s), {precision}",
                                    quickstart_command(devices, accelerator, precision, ["--trainer.strategy=fsdp"], steps, root)))
        else:
            print("fsdp1: skipped (Lightning's FSDPStrategy needs CUDA)")
    if not all(finished):
        raise RuntimeError("a kdlab fit under FSDP failed (its stderr is above)")


def vllm_figures(device: str, smoke: bool) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        print(f"vllm: skipped ({error}; pip install 'kdlab[vllm]' on a CUDA machine)")
        return
    if device != "cuda":
        print("vllm: skipped (vLLM needs CUDA)")
        return
    from kdlab.rollouts.decoding import sample_completions
    from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
    from kdlab.tasks import Countdown
    from kdlab.rollouts.vllm import vllm_sample_completions

    spec = ModelSpec("kdlab://tiny/teacher")
    tokenizer = load_tokenizer(spec)
    task = Countdown(variant="countdown3", num_train=0, num_val=0, num_test=64 if smoke else 512)
    examples = task.examples("test")
    start = time.perf_counter()
    engine = vllm_sample_completions(spec, tokenizer, task, examples, temperature=0.0, max_new_tokens=64, engine_args={"gpu_memory_utilization": 0.3, "dtype": "bfloat16"})
    vllm_s = time.perf_counter() - start
    model = load_causal_lm(spec).to("cuda")
    start = time.perf_counter()
    own = sample_completions(model, tokenizer, task, examples, role="teacher", temperature=0.0, max_new_tokens=64, batch_size=128)
    hf_s = time.perf_counter() - start
    same = sum(a == b for a, b in zip(engine, own))
    print(f"vllm: {len(examples)} greedy tiny-teacher completions: vLLM (bf16) {vllm_s:.1f} s (engine start included), "
          f"kdlab decoder (fp32) {hf_s:.1f} s; identical (text and ended): {same}/{len(examples)}")
    with tempfile.TemporaryDirectory() as root:
        command = quickstart_command(1, "gpu", "32-true", [], 5, root) + [
            "--trainer.log_every_n_steps=1", "--model.rollout=kdlab.rollouts.VLLMRollouts",
            "--model.rollout.sync_every=1", "--model.rollout.gpu_memory_utilization=0.3", "--model.rollout.dtype=bfloat16",
        ]
        if not run_fit("vllm: 5 on-policy quickstart steps with VLLMRollouts (sync every step)", command):
            raise RuntimeError("the kdlab fit with VLLMRollouts failed (its stderr is above)")
        from kdlab.study.runs import read_metrics

        for name in ("train/importance_weight", "train/engine_kl"):  # the KL, not the weight, exposes a stale engine
            values = [value for run in Path(root).rglob("version_*") for _, value in read_metrics(run).get(name, [])]
            print(f"  mean {name}: {statistics.mean(values):.4f} over {len(values)} steps" if values else f"  no {name} logged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens per row in `step` (default 1024; --smoke: 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", nargs="*", default=[], choices=("step", "fsdp", "vllm"))
    parser.add_argument("--smoke", action="store_true", help="toy sizes; runs on the CPU when there is no CUDA")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device: nothing measured (this script is for a GPU machine; --smoke runs it at toy sizes on the CPU)")
        return
    device = "cuda" if cuda else "cpu"
    tokens = args.tokens or (64 if args.smoke else 1024)
    sections = {"step": lambda: step_figures(tokens, args.repeats, device, args.smoke),
                "fsdp": lambda: fsdp_figures(device, args.smoke),
                "vllm": lambda: vllm_figures(device, args.smoke)}
    failed = []
    for name, section in sections.items():
        if name in args.skip:
            continue
        try:
            section()
        except Exception:  # report and go on: one run on a lent GPU should report every section
            failed.append(name)
            print(f"{name}: FAILED\n{traceback.format_exc()[-3000:]}")
        sys.stdout.flush()
    print(f"sections failed: {failed or 'none'}")


if __name__ == "__main__":
    main()
