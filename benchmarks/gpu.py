"""GPU figures for the issue "Scale", written to run unchanged on one CUDA machine:

    python benchmarks/gpu.py [--tokens 1024] [--repeats 5] [--skip-fsdp]

1. ``step``: at the paper's real sizes in bf16 (random-initialised Qwen2 models with the shapes of
   Qwen2.5-1.5B-Instruct and Qwen2.5-7B-Instruct, V = 151,936 / 152,064 rows, nothing downloaded), one
   distillation step (teacher forward, student forward-backward, kdlab's chunked forward KL and the
   exact KL diagnostics) divided by teacher forward + student forward-backward with cross-entropy,
   B = 2, T = ``--tokens``; the same with ``fused_lm_head`` (hidden states + LM head); peak CUDA memory of each.
2. ``fsdp``: ``kdlab fit`` of the tiny-world quickstart for 20 steps under Lightning's
   ``ModelParallelStrategy`` (FSDP2) on every visible GPU with ``bf16-mixed``: seconds per step.

Prints a measurement and exits 0; on a machine without CUDA it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
VOCAB = 151665  # the shared tokenizer's size: logits beyond it are dropped, as kdlab does


def build(shape: dict, dtype: torch.dtype, checkpointing: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("cuda"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False, torch_dtype=dtype)).to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median seconds over ``repeats`` runs after a warm-up, and peak CUDA memory (GiB) of one run."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def step_figures(tokens: int, repeats: int) -> None:
    from kdlab.decoding import completion_head_logits, completion_logits
    from kdlab.objectives import ForwardKL, kl_diagnostics

    student = build(QWEN_1_5B, torch.bfloat16, checkpointing=True)
    teacher = build(QWEN_7B, torch.bfloat16, checkpointing=False).eval().requires_grad_(False)
    ids = torch.randint(0, VOCAB, (2, tokens + 32), device="cuda")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    mask = torch.ones(2, tokens, dtype=torch.bool, device="cuda")
    targets = ids[:, -tokens:]
    objective = ForwardKL()

    def kdlab_step(fused: bool):
        student.zero_grad(set_to_none=True)
        with torch.no_grad():
            t = (completion_head_logits(teacher, inputs, tokens, VOCAB, 0.5) if fused else completion_logits(teacher, inputs, tokens, VOCAB) / 0.5)
        s = completion_head_logits(student, inputs, tokens, VOCAB) if fused else completion_logits(student, inputs, tokens, VOCAB)
        objective(s, t, mask).backward()
        kl_diagnostics(s.detach(), t, mask)

    def floor_step():
        student.zero_grad(set_to_none=True)
        with torch.no_grad():
            completion_logits(teacher, inputs, tokens, VOCAB)
        logits = completion_logits(student, inputs, tokens, VOCAB)
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1)).backward()

    floor, floor_mem = timed(floor_step, repeats)
    plain, plain_mem = timed(lambda: kdlab_step(False), repeats)
    fused, fused_mem = timed(lambda: kdlab_step(True), repeats)
    print(f"step (bf16, Qwen2.5-1.5B shape <- 7B shape, B=2, T={tokens}, {torch.cuda.get_device_name()}):")
    print(f"  floor (teacher forward + student CE fwd/bwd): {floor:.3f} s, peak {floor_mem:.1f} GiB")
    print(f"  kdlab logits path: {plain:.3f} s ({plain / floor:.3f}x, target <= 1.05), peak {plain_mem:.1f} GiB")
    print(f"  kdlab fused_lm_head: {fused:.3f} s ({fused / floor:.3f}x), peak {fused_mem:.1f} GiB")


def fsdp_figures() -> None:
    devices = torch.cuda.device_count()
    command = [
        sys.executable, "-m", "kdlab.cli", "fit", "--config", "experiments/tiny/quickstart.yaml",
        "--trainer.accelerator=gpu", f"--trainer.devices={devices}", "--trainer.precision=bf16-mixed",
        "--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
        f"--trainer.strategy.data_parallel_size={devices}", "--trainer.strategy.tensor_parallel_size=1",
        "--trainer.max_steps=20", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false", f"--model.batch_size={32 // devices}",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    status = "ok" if result.returncode == 0 else f"FAILED:\n{result.stderr[-2000:]}"
    print(f"fsdp: tiny-world quickstart, 20 steps, FSDP2 over {devices} GPU(s), bf16-mixed: {elapsed:.1f} s in all "
          f"(including start-up), {status}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-fsdp", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured (this script is for a GPU machine)")
        return
    step_figures(args.tokens, args.repeats)
    if not args.skip_fsdp:
        fsdp_figures()


if __name__ == "__main__":
    main()
