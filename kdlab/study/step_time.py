"""``kdlab estimate``'s time model: the seconds one optimiser step takes on a :class:`Hardware`, from the same
:class:`~kdlab.study.setups.Setup` the memory arithmetic reads (:mod:`kdlab.study.estimate`). Every constant is
here, stated once; the GPU ones come from published figures (each one's source is in :data:`HARDWARE` and
docs/scaling.md), the op counts from counting kdlab's own code (``tests/test_step_time.py`` recounts them), and
none is fitted to a run's time.

The model. A piece of work costs its host time (PyTorch's eager dispatch: ``ops x op_seconds``) and its device
time (the larger of ``FLOPs / (peak x efficiency)`` and ``bytes / (bandwidth x efficiency)``); on a GPU the host
issues work ahead of the device, so a piece takes the larger of the two, on a CPU one after the other, so their
sum. Per decoded token (each decoding model, batch ``b`` rows, the mean context ``P + C/2``):

* ``kdlab`` (kdlab's decoder, also lm-eval's Hugging Face back end: eager, a host sync every token): host
  ``(layers x OPS_DECODE_LAYER + OPS_DECODE_OUTSIDE) x op_seconds``; device: the memory it moves or ``2 x params x
  b`` FLOPs, whichever is longer. The memory: the weights and the rows' KV cache, read once at the rate a matmul
  streams weights (``bandwidth x decode_bandwidth_efficiency``), and at ``bandwidth`` the arrays between the ops:
  one ``(b, hidden)`` array per op of a layer, each row's fp32 attention scores, the sampling's fp32 ``(b, V)``
  arrays (the ops' traffic grows with the rows; ``benchmarks/estimate_check.py`` compares the whole with real CPU
  fits); a sampled token (not a greedy one) also draws ``b x V`` Exp(1) numbers (``torch.multinomial``'s
  one-sample path, which kdlab's draw reproduces), ``draw_seconds`` each: on a CPU the generator's serial
  arithmetic, about 19 ns a number on this project's machine (``benchmarks/results/estimate_check-cpu.json``), far
  above the bytes it writes; on a GPU the draw is one
  more bandwidth-bound pass, 0 beyond the sampling passes. On a CPU an eager op's cost also grows with its
  size well beyond the bytes it moves (small cache-resident arrays, attention's per-row and per-head work):
  ``element_seconds`` per element of the ops' ``(b, hidden)`` arrays, measured as the growth of a calibration
  model's decode from 1 row to 64 (``benchmarks/estimate_check.py``); the ops' time is the larger of that and
  their bytes at ``bandwidth`` (0 on a GPU: the bytes);
* ``vllm`` (CUDA graphs: one launch per step, so no per-op host time; its scheduler's own time is not counted):
  the same device time;
* ``served`` (a vLLM server on the same kind of GPU): as ``vllm``.

A prefill is ``2 x params x b x P`` FLOPs and one forward's ops. Training a micro-batch of ``T`` tokens:
:func:`~kdlab.study.estimate.step_work`'s FLOPs at ``train_efficiency``, host ``layers x (OPS_FORWARD_LAYER +
OPS_BACKWARD_LAYER (+ OPS_FORWARD_LAYER recomputed with activation checkpointing))``; the objective's chunks
``OPS_OBJECTIVE_CHUNK`` ops each and 12 passes over an fp32 ``(rows, V)`` in memory; the optimiser step (with
clipping) ``OPS_OPTIMISER_TENSOR`` ops per parameter tensor and its weights, gradients and two moments read and
written once. An evaluation's rows also cost ``row_seconds`` each on the host, outside their decodes (the prompt
rendered and tokenized, the completion's text, the task's verifier). Not counted: Lightning's own per-step work,
logging, checkpoint writes, data loading, the time a vLLM engine takes to receive new weights, and communication
between GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdlab.study.setups import BYTES, Setup
from kdlab.study.shapes import Shape

# ---- op counts: aten ops PyTorch dispatches, counted with a TorchDispatchMode on Qwen2 (tests/test_step_time.py)
OPS_DECODE_LAYER = 72  # one decoder layer, one token of kdlab's decoder with a KV cache
OPS_DECODE_OUTSIDE = 55.625  # embedding, final norm, head, sampling, cache bookkeeping; the finished-rows check every 8 tokens, averaged
OPS_FORWARD_LAYER = 77  # one decoder layer's training forward
OPS_BACKWARD_LAYER = 151  # and its backward
OPS_FORWARD_OUTSIDE = 25  # embedding, final norm, head (forward)
OPS_BACKWARD_OUTSIDE = 31
OPS_OBJECTIVE_CHUNK = 80  # one chunk of a closed-form KL, forward and gradient
OPS_OPTIMISER_TENSOR = 15  # gradient clipping and FiniteAdamW's step, per parameter tensor (single-tensor loop)
OBJECTIVE_PASSES = 12  # fp32 (rows, V) arrays read or written by a chunked objective (probabilities, scratch, gradient)
SAMPLING_PASSES = 12  # fp32 (rows, V) arrays a token's sampling writes and reads: log-softmax, exp, entropy, draw (6 each, as the memory model)


TENSORS_PER_LAYER = {False: 9, True: 12}  # parameter tensors of a Llama / Qwen2 layer: 4 attention, 3 MLP, 2 norms (+ q, k, v biases)


@dataclass(frozen=True)
class Hardware:
    """One device's constants, each with its source (``sources``: the URL or the measurement it comes from)."""

    name: str
    flops: float  # peak dense FLOP/s of the training dtype (bf16 tensor cores on a GPU)
    bandwidth: float  # memory bytes/s
    op_seconds: float  # host seconds per dispatched aten op in eager PyTorch
    train_efficiency: float  # share of ``flops`` a training forward/backward reaches (MFU)
    decode_bandwidth_efficiency: float  # share of ``bandwidth`` a decode step's weight reads reach
    overlapped: bool = True  # the host issues work ahead of the device (GPU): a piece takes max(host, device)
    sources: dict[str, str] = field(default_factory=dict)
    row_seconds: float = 0.0  # host seconds per evaluated row outside its decode: prompt tokenized, completion's text, verifier
    draw_seconds: float = 0.0  # seconds per Exp(1) number a sampled token draws (b x V of them) beyond its bytes (0 on a GPU)
    element_seconds: float = 0.0  # seconds per element of a decode op's (b, hidden) array, when more than its bytes cost (0 on a GPU)


NVIDIA_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
NVIDIA_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
DISPATCH = "https://jiahuanglin.xyz/all_lessons/gpu_kernel_serving/18_pytorch_to_kernel.html"
MFU = "https://pypi.org/project/mfu-tracker/"
GRAPHS = "https://cloudai.pt/tag/cuda-graphs/"
_COMMON = {
    "op_seconds": f"5-25 us of CPU-side dispatch per eager op on an H100 ({DISPATCH}); 10 us taken",
    "train_efficiency": f"MFU of well-optimised large models 0.40-0.60, small ones lower ({MFU}); 0.40 taken",
    "decode_bandwidth_efficiency": f"Llama 3.1 8B decode step under a CUDA graph on an H100 SXM, 5.1 ms ({GRAPHS}): "
                                   "8.03e9 x 2 B / 3.35 TB/s = 4.79 ms of weight reads, 4.79 / 5.1 = 0.94",
    "row_seconds": "host work, the same on a GPU machine as on a CPU: kdlab's tokenizing, detokenizing and verifying "
                   "measured 0.1-0.6 ms per row on this project's CPU (benchmarks/results/estimate_check-cpu.json, "
                   "outside_decodes_s / rows); 1 ms taken",
}
GPU_ROW_SECONDS = 1e-3
HARDWARE = {
    "H200": Hardware("H200", 989e12, 4.8e12, 10e-6, 0.40, 0.94, True,
                     {"flops": f"H200 SXM BF16 tensor core 1,979 TFLOPS with sparsity, half dense ({NVIDIA_H200})",
                      "bandwidth": f"H200 SXM HBM3e 4.8 TB/s ({NVIDIA_H200})", **_COMMON}, GPU_ROW_SECONDS),
    "H100": Hardware("H100", 989e12, 3.35e12, 10e-6, 0.40, 0.94, True,
                     {"flops": f"H100 SXM BF16 tensor core 1,979 TFLOPS with sparsity, half dense ({NVIDIA_H100})",
                      "bandwidth": f"H100 SXM HBM3 3.35 TB/s ({NVIDIA_H100})", **_COMMON}, GPU_ROW_SECONDS),
}
"""The GPUs ``kdlab estimate --gpu_kind`` knows. A CPU's constants are measured (``benchmarks/estimate_check.py``)."""


def combine(hardware: Hardware, host: float, device: float) -> float:
    return max(host, device) if hardware.overlapped else host + device


def weight_bytes(shape: Shape, dtype_bytes: int) -> float:
    return shape.params * dtype_bytes


def decode_token_seconds(shape: Shape, dtype_bytes: int, rows: int, context: float, backend: str, hardware: Hardware,
                         sampled: bool = True) -> float:
    """Seconds for one token of ``rows`` rows on one model (module docstring): ``backend`` ``kdlab`` (eager, also
    lm-eval's HF back end), ``vllm`` or ``served`` (CUDA graphs); ``sampled`` False for a greedy token (no draw)."""
    if backend not in ("kdlab", "vllm", "served"):
        raise ValueError(f"decode back end must be kdlab, vllm or served, got {backend!r}")
    kv = rows * context * 2 * shape.layers * shape.kv_dim * dtype_bytes
    streamed = (weight_bytes(shape, dtype_bytes) + kv) / (hardware.bandwidth * hardware.decode_bandwidth_efficiency)
    elements = rows * shape.layers * OPS_DECODE_LAYER * shape.hidden  # each op of a layer moves one (rows, hidden) array
    ops = max(elements * dtype_bytes / hardware.bandwidth, elements * hardware.element_seconds)
    scores = rows * shape.layers * 2 * 4 * shape.heads * context  # attention scores, fp32, written and read
    sampling = SAMPLING_PASSES * rows * shape.vocab * 4
    memory = streamed + ops + (scores + sampling) / hardware.bandwidth
    device = max(memory, 2 * shape.params * rows / (hardware.flops * hardware.train_efficiency))
    if sampled:
        device += rows * shape.vocab * hardware.draw_seconds
    host = (shape.layers * OPS_DECODE_LAYER + OPS_DECODE_OUTSIDE) * hardware.op_seconds if backend == "kdlab" else 0.0
    return combine(hardware, host, device)


def forward_seconds(shape: Shape, tokens: float, hardware: Hardware, passes: int = 2, backward: bool = False, recompute: bool = False) -> float:
    """A forward (``passes = 2``: ``2 x params x tokens`` FLOPs) or a training forward and backward (``passes``
    from :func:`~kdlab.study.estimate.step_work`) over ``tokens`` tokens."""
    ops = shape.layers * OPS_FORWARD_LAYER + OPS_FORWARD_OUTSIDE
    if backward:
        ops += shape.layers * (OPS_BACKWARD_LAYER + (OPS_FORWARD_LAYER if recompute else 0)) + OPS_BACKWARD_OUTSIDE
    return combine(hardware, ops * hardware.op_seconds, passes * shape.params * tokens / (hardware.flops * hardware.train_efficiency))


def decode_seconds(shape: Shape, dtype_bytes: int, rows: int, prompt: int, completion: int, backend: str, hardware: Hardware,
                   sampled: bool = True) -> float:
    """One batched decode: the prefill of ``rows x prompt`` tokens and ``completion`` token steps (the cap: a
    decode ends when its longest row does)."""
    if rows <= 0 or completion <= 0:
        return 0.0
    prefill = forward_seconds(shape, rows * prompt, hardware)
    return prefill + completion * decode_token_seconds(shape, dtype_bytes, rows, prompt + completion / 2, backend, hardware, sampled)


@dataclass
class StepTime:
    """Seconds of one optimiser step, per part (per rank; the ranks run in parallel)."""

    parts: dict[str, float]
    hardware: Hardware

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


def _size(setup: Setup, role: str) -> int:
    return 2 if setup.mixed or BYTES[setup.student_dtype if role == "student" else setup.teacher_dtype] == 2 else 4


def step_time(setup: Setup, work: dict[str, float], hardware: Hardware) -> StepTime:
    """The parts of one optimiser step: decode (each decoding model; vLLM's engine with ``VLLMRollouts``), the
    teacher's forward, the trained model's forward and backward, the objective, the optimiser step."""
    s, t = setup.student, setup.teacher
    parts: dict[str, float] = {}
    decodes, rows = float(work["decodes"]), setup.rows_per_decode
    models = setup.decoders or ((setup.engine,) if setup.engine else ())
    for role in models:
        shape = t if role == "teacher" and t is not None else s
        backend = "vllm" if setup.engine else "served" if role == "teacher" and setup.served else "kdlab"
        parts[f"decode ({role}, {backend})"] = decodes * decode_seconds(shape, _size(setup, role), rows, setup.prompt_tokens,
                                                                        setup.completion_tokens, backend, hardware)
    tokens = setup.batch_size * (setup.prompt_tokens + setup.completion_tokens)
    micro = setup.accumulate
    if t is not None and not setup.cached_teacher:
        parts["teacher forward" if setup.stage != "grpo" else "reference forward"] = micro * forward_seconds(t, tokens, hardware)
    if setup.stage == "grpo" and work["decodes"] and work["decodes"] < 1:  # pi_old recomputed over the decode's rows
        parts["old log-probs"] = decodes * -(-rows // setup.batch_size) * forward_seconds(s, tokens, hardware)
    passes = 4 + (0 if setup.lora_rank else 2) + (2 if setup.checkpointing else 0)
    parts["forward and backward"] = micro * forward_seconds(s, tokens, hardware, passes, backward=True, recompute=setup.checkpointing)
    loss_rows = setup.batch_size * setup.completion_tokens
    chunks = -(-loss_rows // max(setup.chunk_size, 1))
    objective_bytes = OBJECTIVE_PASSES * loss_rows * s.vocab * 4
    parts["objective"] = micro * combine(hardware, chunks * OPS_OBJECTIVE_CHUNK * hardware.op_seconds, objective_bytes / hardware.bandwidth)
    tensors = s.layers * TENSORS_PER_LAYER[s.qkv_bias] + (2 if s.tied else 3)
    if setup.lora_rank:
        tensors = s.layers * 14  # A and B of 7 projections
    shard = setup.shard if setup.strategy in ("fsdp2", "fsdp1") else 1
    moved = setup.trainable / shard * 4 * (setup.adapter_bytes if setup.lora_rank else BYTES[setup.student_dtype]) * 2  # weights, gradients, 2 moments; read, written
    parts["optimiser step"] = combine(hardware, tensors * OPS_OPTIMISER_TENSOR * hardware.op_seconds, moved / hardware.bandwidth)
    return StepTime(parts, hardware)
