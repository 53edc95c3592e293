#!/usr/bin/env python
"""Check every vLLM name kdlab relies on against the real classes of the pinned vLLM release; no GPU needed.

    python scripts/check_vllm_api.py [--version 0.33.0] [--venv /tmp/kdlab-vllm-api]

vLLM is installed without its dependencies (``pip install --no-deps vllm==<version>``, from PyPI) into a
side virtual environment outside the repository (created when missing, reused when it already holds that
version). Its source is read, not imported (its dependencies, CUDA among them, are not installed), except
``vllm/logprobs.py``, which needs only the standard library and is run to build the log-prob containers
vLLM returns. The default version is :data:`kdlab.rollouts.vllm.VLLM_VERSION`.

Checked, each printed as ``ok`` or ``FAIL`` (exit status 1 when any fails, 2 when vLLM cannot be installed):

* :data:`kdlab.rollouts.vllm.VLLM_API`, the names the tests' stand-in for vLLM accepts: ``vllm.LLM``,
  ``vllm.SamplingParams`` and ``vllm.TokensPrompt`` are exported; every ``SamplingParams`` keyword is one
  of its fields; every ``LLM`` keyword is a parameter of ``LLM.__init__`` or an ``EngineArgs`` field (which
  ``LLM`` receives through ``**kwargs``); ``generate``, ``collective_rpc`` and ``reset_prefix_cache``
  take what kdlab passes the way kdlab passes it; ``TokensPrompt`` has ``prompt_token_ids``; the output
  fields kdlab reads exist on ``RequestOutput``, ``CompletionOutput`` and ``Logprob``;
* the keywords :func:`kdlab.rollouts.vllm_sampling.sampling_params` actually produces are ``SamplingParams`` fields;
* :data:`kdlab.rollouts.vllm.VLLM_SETTING_VALUES` (``logprobs_mode``, ``distributed_executor_backend``) are
  values of the ``Literal`` types vLLM declares for those settings;
* sampling values: vLLM raises temperatures below ``VLLM_TEMPERATURES[0]`` to it and rejects those above
  ``VLLM_TEMPERATURES[1]``; ``top_k=-1`` (kdlab's "off") is accepted;
* weight pushes: the worker extension is mixed into the worker from ``worker_extension_cls``, the GPU
  worker has ``model_runner``, whose class has ``get_model``; Qwen2's and Llama's vLLM models have
  ``load_weights`` taking an ``Iterable`` of (name, tensor) (so a generator streams into it);
  ``VLLM_ENABLE_V1_MULTIPROCESSING`` is an environment variable vLLM reads; with it off the engine core is
  in-process and ``LLM.collective_rpc`` reaches the worker's method with ``args`` unchanged (a generator
  is not serialised); the ``external_launcher`` executor asserts it is off (why
  :func:`kdlab.rollouts.vllm.colocated_engine_args` sets it for every colocated engine, teacher's too);
* engine settings: :data:`kdlab.rollouts.vllm.ENGINE_DTYPES` are values of vLLM's ``ModelDType`` naming the
  same torch dtypes; ``gpu_memory_utilization`` is a fraction of the device's total memory, and
  :data:`~kdlab.rollouts.vllm.VLLM_PROFILE_TOKENS` / :data:`~kdlab.rollouts.vllm.VLLM_PROFILE_SEQUENCES`
  are vLLM's largest default ``max_num_batched_tokens`` / ``max_num_seqs`` for ``vllm.LLM`` (what
  :func:`kdlab.rollouts.vllm.engine_memory_fraction` sizes the profiled activations with);
* the served sampler's server check: ``GET /server_info?config_format=json`` dumps ``vllm_config`` as JSON, whose
  sections and fields hold :data:`kdlab.rollouts.served_sampler.SERVER_SETTINGS`;
* the log-prob output format: :func:`kdlab.rollouts.vllm_sampling.sampled_token_logprobs` reads the sampled tokens'
  log-probs from both containers vLLM fills (a list of ``{token: Logprob}`` dicts and ``FlatLogprobs``),
  built with vLLM's own ``append_logprobs_for_next_position`` as its engine does for ``logprobs=0``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdlab.rollouts.served_sampler import SERVER_SETTINGS  # noqa: E402
from kdlab.rollouts.served import COMPLETION_REQUEST_FIELDS, COMPLETION_RESPONSE_FIELDS, MODEL_FIELDS, TOKENIZE_FIELDS  # noqa: E402
from kdlab.rollouts.vllm import (
    ENGINE_DTYPES,
    VLLM_API,
    VLLM_PROFILE_SEQUENCES,
    VLLM_PROFILE_TOKENS,
    VLLM_SETTING_VALUES,
    VLLM_VERSION,
)  # noqa: E402
from kdlab.rollouts.vllm_sampling import VLLM_TEMPERATURES, sampled_token_logprobs, sampling_params  # noqa: E402


# ---- the side environment ----------------------------------------------------------------------------
def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python*/site-packages")
    return found


def installed_version(venv: Path) -> str | None:
    if not venv.exists():
        return None
    infos = list(site_packages(venv).glob("vllm-*.dist-info"))
    return infos[0].name[len("vllm-") : -len(".dist-info")] if infos else None


def install(venv: Path, version: str) -> Path:
    """``vllm/`` of ``vllm==version`` installed without dependencies in ``venv`` (outside the repository)."""
    if venv.resolve().is_relative_to(ROOT):
        raise SystemExit(f"--venv {venv} is inside the repository; give a folder outside it, e.g. /tmp/kdlab-vllm-api")
    if installed_version(venv) != version:
        if not venv.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", f"vllm=={version}"]
        print("$", " ".join(pip), flush=True)
        if subprocess.run(pip).returncode != 0:
            raise SystemExit(2)
    if installed_version(venv) != version:
        print(f"vllm=={version} is not in {venv} after installing", file=sys.stderr)
        raise SystemExit(2)
    return site_packages(venv) / "vllm"


# ---- reading the source --------------------------------------------------------------------------------
class Source:
    """Parsed files of the installed ``vllm`` package."""

    def __init__(self, package: Path) -> None:
        self.package, self._trees = package, {}

    def read(self, relative: str) -> str:
        return (self.package / relative).read_text(encoding="utf-8")

    def tree(self, relative: str) -> ast.Module:
        if relative not in self._trees:
            self._trees[relative] = ast.parse(self.read(relative))
        return self._trees[relative]

    def text(self, relative: str) -> str:
        return self.read(relative)

    def module_file(self, dotted: str) -> str:
        """``vllm/<dotted>`` as a file path relative to the package (``.inputs`` -> ``inputs/__init__.py``)."""
        path = dotted.lstrip(".").replace(".", "/")
        return f"{path}/__init__.py" if (self.package / path).is_dir() else f"{path}.py"

    def cls(self, relative: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(relative)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise LookupError(f"no class {name} in vllm/{relative}")

    def exported(self, name: str) -> tuple[str, ast.ClassDef]:
        """(file, class) of ``vllm.<name>``, from the lazy-import table in ``vllm/__init__.py``."""
        for node in ast.walk(self.tree("__init__.py")):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Constant):
                        module, attr = value.value.split(":")
                        return self.resolve(self.module_file(module), attr)
        raise LookupError(f"vllm does not export {name}")

    def resolve(self, relative: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef]:
        """(file, class) of class ``name`` defined in ``relative`` or re-exported there (``from .x import name``)."""
        for node in self.tree(relative).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return relative, node
        for node in ast.walk(self.tree(relative)):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and any(a.name == name for a in node.names) and depth < 5:
                base = str(Path(relative).parent).replace("/", ".").strip(".")
                module = f"{base}.{node.module}" if base else node.module
                return self.resolve(self.module_file(module), name, depth + 1)
        raise LookupError(f"no class {name} in vllm/{relative}")


def fields(cls: ast.ClassDef) -> set[str]:
    """Annotated class attributes (dataclass, msgspec and TypedDict fields) and ``self.<x> =`` in ``__init__``."""
    names = {node.target.id for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    init = method(cls, "__init__", required=False)
    if init is not None:
        for node in ast.walk(init):
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    names.add(target.attr)
    return names


def method(cls: ast.ClassDef, name: str, required: bool = True) -> ast.FunctionDef | None:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    if required:
        raise LookupError(f"{cls.name} has no method {name}")
    return None


def parameters(function: ast.FunctionDef) -> dict[str, str]:
    """``{name: kind}`` with kind ``positional`` (positional or keyword), ``keyword`` (keyword-only) or ``**``."""
    args = function.args
    kinds = {a.arg: "positional" for a in args.posonlyargs + args.args}
    kinds.update({a.arg: "keyword" for a in args.kwonlyargs})
    if args.kwarg is not None:
        kinds["**"] = args.kwarg.arg
    kinds.pop("self", None)
    return kinds


def required_parameters(function: ast.FunctionDef) -> list[str]:
    args = function.args
    positional = args.posonlyargs + args.args
    without_default = positional[: len(positional) - len(args.defaults)]
    keyword = [a for a, default in zip(args.kwonlyargs, args.kw_defaults) if default is None]
    return [a.arg for a in without_default + keyword if a.arg != "self"]


def literal_values(tree: ast.Module, name: str) -> set[str]:
    """The strings of ``<name> = Literal["a", "b", ...]`` in a module."""
    for node in ast.walk(tree):
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(getattr(node, "value", None), ast.Subscript):
            return {c.value for c in ast.walk(node.value.slice) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    raise LookupError(f"no Literal {name}")


def annotation_name(cls: ast.ClassDef, field: str) -> str:
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == field:
            return ast.unparse(node.annotation)
    raise LookupError(f"{cls.name} has no field {field}")


def load_standalone(package: Path, relative: str, name: str) -> types.ModuleType:
    """Run one vLLM file that needs only the standard library, as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, package / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---- the checks ----------------------------------------------------------------------------------------
def checks(source: Source) -> list[tuple[str, Any]]:
    """(description, callable raising AssertionError/LookupError on failure) for every claim."""
    result: list[tuple[str, Any]] = []

    def check(description: str):
        def register(function):
            result.append((description, function))
            return function
        return register

    for name in ("LLM", "SamplingParams", "TokensPrompt", "RequestOutput", "CompletionOutput"):
        check(f"vllm.{name} is exported")(lambda name=name: source.exported(name))

    def sampling_fields() -> set[str]:
        return fields(source.exported("SamplingParams")[1])

    @check(f"SamplingParams has the fields kdlab passes {sorted(VLLM_API['SamplingParams'])}")
    def _():
        missing = set(VLLM_API["SamplingParams"]) - sampling_fields()
        assert not missing, f"not SamplingParams fields: {sorted(missing)}"

    @check("kdlab.rollouts.vllm_sampling.sampling_params produces only SamplingParams fields, all listed in VLLM_API")
    def _():
        produced = set()
        for stop in ((), ("</answer>",)):
            for logprobs in (True, False):
                produced |= set(sampling_params(1.0, 8, (1,), top_p=0.9, seed=1, logprobs=logprobs, stop=stop))
        assert produced <= sampling_fields(), f"not SamplingParams fields: {sorted(produced - sampling_fields())}"
        assert produced <= set(VLLM_API["SamplingParams"]), f"missing from VLLM_API: {sorted(produced - set(VLLM_API['SamplingParams']))}"

    def llm() -> ast.ClassDef:
        return source.exported("LLM")[1]

    @check(f"LLM(...) takes the keywords kdlab passes {sorted(VLLM_API['LLM'])} (its own or EngineArgs')")
    def _():
        own = parameters(method(llm(), "__init__"))
        engine_args = fields(source.cls("engine/arg_utils.py", "EngineArgs"))
        init_source = ast.unparse(method(llm(), "__init__"))
        assert "**" in own and f"**{own['**']}" in init_source and "EngineArgs(" in init_source, "LLM no longer passes **kwargs to EngineArgs"
        missing = {name for name in VLLM_API["LLM"] if name not in own and name not in engine_args}
        assert not missing, f"neither LLM.__init__ parameters nor EngineArgs fields: {sorted(missing)}"
        assert own.get("model") == "positional", "LLM's first parameter is no longer model"

    @check("LLM.generate(prompts, sampling_params, use_tqdm=...) as kdlab calls it")
    def _():
        generate = method(llm(), "generate")
        params = list(parameters(generate).items())
        assert params[0] == ("prompts", "positional") and params[1] == ("sampling_params", "positional"), params[:2]
        assert dict(params).get("use_tqdm") in ("positional", "keyword"), "no use_tqdm"
        assert set(VLLM_API["LLM.generate"]) <= dict(params).keys()
        assert "RequestOutput" in ast.unparse(generate.returns), f"returns {ast.unparse(generate.returns)}"

    @check("LLM.collective_rpc(method, args=...) and LLM.reset_prefix_cache() as kdlab calls them")
    def _():
        rpc = parameters(method(llm(), "collective_rpc"))
        assert list(rpc)[0] == "method" and set(VLLM_API["LLM.collective_rpc"]) <= rpc.keys(), rpc
        reset = method(llm(), "reset_prefix_cache")
        assert required_parameters(reset) == [], f"reset_prefix_cache now requires {required_parameters(reset)}"

    @check("TokensPrompt(prompt_token_ids=...) is a TypedDict with that key")
    def _():
        relative, cls = source.exported("TokensPrompt")
        missing = set(VLLM_API["TokensPrompt"]) - fields(cls)
        assert not missing, f"TokensPrompt has no {sorted(missing)}"

    @check("outputs: RequestOutput.outputs, CompletionOutput.token_ids / .logprobs (SampleLogprobs), Logprob.logprob")
    def _():
        for name in ("RequestOutput", "CompletionOutput"):
            missing = set(VLLM_API[name]) - fields(source.exported(name)[1])
            assert not missing, f"{name} has no {sorted(missing)}"
        completion = source.exported("CompletionOutput")[1]
        assert "SampleLogprobs" in annotation_name(completion, "logprobs"), annotation_name(completion, "logprobs")
        missing = set(VLLM_API["Logprob"]) - fields(source.cls("logprobs.py", "Logprob"))
        assert not missing, f"Logprob has no {sorted(missing)}"

    @check(f"setting values {VLLM_SETTING_VALUES} are among vLLM's declared values")
    def _():
        declared = {
            "logprobs_mode": literal_values(source.tree("config/model.py"), "LogprobsMode"),
            "distributed_executor_backend": literal_values(source.tree("config/parallel.py"), "DistributedExecutorBackend"),
        }
        for setting, value in VLLM_SETTING_VALUES.items():
            assert value in declared[setting], f"{setting}={value!r} not in {sorted(declared[setting])}"

    @check(f"temperatures: vLLM clamps (0, {VLLM_TEMPERATURES[0]}) up and rejects > {VLLM_TEMPERATURES[1]}; top_k=-1 is accepted")
    def _():
        text = source.text("sampling_params.py")
        tree = source.tree("sampling_params.py")
        clamp = [n.value.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_MAX_TEMP"]
        assert clamp and float(clamp[0]) == VLLM_TEMPERATURES[0], f"_MAX_TEMP = {clamp}"
        assert f"self.temperature > {VLLM_TEMPERATURES[1]}" in text, "the upper temperature bound moved"
        assert "if self.top_k < -1:" in text, "top_k=-1 may no longer be accepted"

    @check("weight pushes: worker_extension_cls is mixed into the worker; Worker.model_runner; GPUModelRunner.get_model; Qwen2ForCausalLM.load_weights")
    def _():
        assert "worker_extension_cls" in fields(source.cls("engine/arg_utils.py", "EngineArgs"))
        wrapper = ast.unparse(source.cls("v1/worker/worker_base.py", "WorkerWrapperBase"))
        assert "parallel_config.worker_extension_cls" in wrapper and "__bases__" in wrapper, "the extension is no longer mixed in"
        worker = ast.unparse(source.cls("v1/worker/gpu_worker.py", "Worker"))
        assert "self.model_runner" in worker, "Worker has no model_runner"
        method(source.cls("v1/worker/gpu_model_runner.py", "GPUModelRunner"), "get_model")
        method(source.cls("model_executor/models/qwen2.py", "Qwen2ForCausalLM"), "load_weights")
        method(source.cls("model_executor/models/llama.py", "LlamaForCausalLM"), "load_weights")

    @check("served sampler's check: GET /server_info?config_format=json dumps vllm_config with the fields SERVER_SETTINGS reads")
    def _():
        text = source.text("entrypoints/serve/dev/server_info/api_router.py")
        assert '@router.get("/server_info")' in text and "config_format" in text, "/server_info or its config_format moved"
        assert '"vllm_config"' in text and "PydanticVllmConfig.dump_python(vllm_config, mode=\"json\"" in text, "vllm_config is no longer dumped as JSON"
        assert "attach_server_info_router(app)" in source.text("entrypoints/serve/__init__.py"), "/server_info is no longer attached"
        sections = {"model_config": ("config/model.py", "ModelConfig"), "parallel_config": ("config/parallel.py", "ParallelConfig")}
        config = fields(source.cls("config/vllm.py", "VllmConfig"))
        for (section, field), (value, _) in SERVER_SETTINGS.items():
            assert section in config, f"VllmConfig has no {section}"
            assert field in fields(source.cls(*sections[section])), f"{sections[section][1]} has no {field}"
        assert SERVER_SETTINGS[("model_config", "logprobs_mode")][0] in literal_values(source.tree("config/model.py"), "LogprobsMode")

    @check("VLLM_ENABLE_V1_MULTIPROCESSING is an environment variable vLLM reads")
    def _():
        assert '"VLLM_ENABLE_V1_MULTIPROCESSING"' in source.text("envs.py")

    @check("the external_launcher executor asserts VLLM_ENABLE_V1_MULTIPROCESSING is off (set for every colocated engine)")
    def _():
        launcher = method(source.cls("v1/executor/uniproc_executor.py", "ExecutorWithExternalLauncher"), "_init_executor")
        assert "assert not envs.VLLM_ENABLE_V1_MULTIPROCESSING" in ast.unparse(launcher), "the assertion moved or changed"

    @check("in-process engine: LLM.collective_rpc reaches the worker's method with args unchanged (a generator streams)")
    def _():
        engine = source.text("v1/engine/llm_engine.py")
        assert "multiprocess_mode=envs.VLLM_ENABLE_V1_MULTIPROCESSING" in engine, "the engine core process no longer follows the variable"
        assert "return InprocClient(" in ast.unparse(method(source.cls("v1/engine/core_client.py", "EngineCoreClient"), "make_client"))
        hops = [
            (llm(), "self.llm_engine.collective_rpc(method, timeout, args, kwargs)"),
            (source.cls("v1/engine/llm_engine.py", "LLMEngine"), "self.engine_core.collective_rpc(method, timeout, args, kwargs)"),
            (source.cls("v1/engine/core_client.py", "InprocClient"), "self.engine_core.collective_rpc(method, timeout, args, kwargs)"),
            (source.cls("v1/engine/core.py", "EngineCore"), "self.model_executor.collective_rpc(method, timeout, args, kwargs)"),
            (source.cls("v1/executor/uniproc_executor.py", "UniProcExecutor"), "run_method(self.driver_worker, method, args, kwargs)"),
        ]
        for cls, call in hops:
            assert call in ast.unparse(method(cls, "collective_rpc")), f"{cls.name}.collective_rpc no longer calls {call}"
        run = ast.unparse(next(n for n in source.tree("v1/serial_utils.py").body if isinstance(n, ast.FunctionDef) and n.name == "run_method"))
        assert "getattr(obj, method)" in run and "func(*args, **kwargs)" in run, "run_method no longer calls the method with args as given"
        assert "getattr(self.worker, attr)" in ast.unparse(method(source.cls("v1/worker/worker_base.py", "WorkerWrapperBase"), "__getattr__"))

    @check("load_weights of Qwen2ForCausalLM and LlamaForCausalLM takes an Iterable of (name, tensor)")
    def _():
        for relative, name in (("model_executor/models/qwen2.py", "Qwen2ForCausalLM"), ("model_executor/models/llama.py", "LlamaForCausalLM")):
            load = method(source.cls(relative, name), "load_weights")
            annotation = ast.unparse(load.args.args[1].annotation)
            assert annotation.startswith("Iterable[tuple[str"), f"{name}.load_weights takes {annotation}"

    @check(f"engine dtypes {sorted(ENGINE_DTYPES)} are vLLM ModelDType values naming the same torch dtypes")
    def _():
        declared = literal_values(source.tree("config/model.py"), "ModelDType")
        assert set(ENGINE_DTYPES) <= declared, f"not ModelDType values: {sorted(set(ENGINE_DTYPES) - declared)}"
        text = source.text("config/model.py")
        for name, dtype in ENGINE_DTYPES.items():
            assert f'"{name}": {dtype},' in text, f"vLLM's {name!r} is no longer {dtype}"

    @check("gpu_memory_utilization is a fraction of the device's total memory; the profiling batch defaults kdlab sizes with")
    def _():
        request = ast.unparse(next(n for n in source.tree("v1/worker/utils.py").body if isinstance(n, ast.FunctionDef) and n.name == "request_memory"))
        assert "init_snapshot.total_memory * cache_config.gpu_memory_utilization" in request, "the budget is no longer total x fraction"
        defaults: dict[str, list[int]] = {"default_max_num_batched_tokens": [], "default_max_num_seqs": []}
        for node in ast.walk(source.tree("engine/arg_utils.py")):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in defaults:
                if isinstance(node.value, ast.Dict):
                    for key, value in zip(node.value.keys, node.value.values):
                        if ast.unparse(key) == "UsageContext.LLM_CLASS" and isinstance(value, ast.Constant):
                            defaults[node.targets[0].id].append(value.value)
        assert defaults["default_max_num_batched_tokens"] and max(defaults["default_max_num_batched_tokens"]) == VLLM_PROFILE_TOKENS, defaults
        assert defaults["default_max_num_seqs"] and max(defaults["default_max_num_seqs"]) == VLLM_PROFILE_SEQUENCES, defaults

    # the served teacher's HTTP requests and replies (kdlab.rollouts.served), class by class of vLLM's server
    served_classes = {"CompletionRequest": "entrypoints/openai/completion/protocol.py",
                      "CompletionResponse": "entrypoints/openai/completion/protocol.py",
                      "CompletionResponseChoice": "entrypoints/openai/completion/protocol.py",
                      "TokenizeCompletionRequest": "entrypoints/serve/tokenize/protocol.py",
                      "TokenizeResponse": "entrypoints/serve/tokenize/protocol.py",
                      "ModelCard": "entrypoints/serve/engine/protocol.py", "ModelList": "entrypoints/serve/engine/protocol.py",
                      "Logprob": "logprobs.py"}
    served_fields = {"CompletionRequest": COMPLETION_REQUEST_FIELDS, **COMPLETION_RESPONSE_FIELDS, **TOKENIZE_FIELDS, **MODEL_FIELDS}
    for name, wanted in served_fields.items():
        @check(f"served teacher: vLLM's {name} has the fields kdlab sends or reads {sorted(wanted)}")
        def _(name=name, wanted=wanted):
            missing = set(wanted) - fields(source.cls(served_classes[name], name))
            assert not missing, f"not {name} fields: {sorted(missing)}"

    @check("served teacher: prompt log-probs skip the sampling processors (no temperature), so kdlab tempers them")
    def _():
        text = source.read("v1/worker/gpu_model_runner.py")
        assert "prompt tokens skip sampling processors" in text, "vLLM's prompt log-probs note is gone: re-read how they are computed"

    @check("served teacher: prompt_logprobs -1 asks for the whole vocabulary; -inf is sent as -9999.0")
    def _():
        assert "prompt_logprobs != -1" in source.read("entrypoints/openai/completion/protocol.py")
        assert "-9999.0" in source.read("entrypoints/generate/base/serving.py")

    @check("served teacher: one /v1/completions request may carry several token-id prompts (a choice per prompt, by index)")
    def _():
        import re

        text = source.read("entrypoints/openai/completion/protocol.py")
        annotation = re.search(r"\n    prompt: (\(.*?\)|[^\n=]+) = None", text, re.S)  # one line or a parenthesised union
        assert annotation, "CompletionRequest.prompt is gone"
        kinds = annotation.group(1).replace(" ", "").replace("\n", "")
        assert "list[list[int]]" in kinds or "list[list[Annotated[int" in kinds, kinds

    @check("log-prob format: sampled_token_logprobs reads vLLM's list-of-dicts and FlatLogprobs containers")
    def _():
        logprobs = load_standalone(source.package, "logprobs.py", "_vllm_logprobs")
        tokens, values = [5, 6, 2], [-0.25, -1.5, -0.125]
        for flat in (False, True):
            container = logprobs.create_sample_logprobs(flat)
            for token, value in zip(tokens, values):
                # as vLLM's engine does with logprobs=0: the sampled token, its rank, no top-k entries
                logprobs.append_logprobs_for_next_position(container, [token], [value], [None], 3, 0)
            sample = types.SimpleNamespace(token_ids=tokens, logprobs=container)
            read = sampled_token_logprobs(sample)
            assert read == values, f"{type(container).__name__}: read {read}, expected {values}"

    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=VLLM_VERSION, help=f"the vLLM release (default {VLLM_VERSION})")
    parser.add_argument("--venv", type=Path, default=None, help="side environment (default /tmp/kdlab-vllm-api-<version>)")
    args = parser.parse_args(argv)
    venv = args.venv or Path(f"/tmp/kdlab-vllm-api-{args.version}")
    package = install(venv, args.version)
    print(f"vLLM {args.version} at {package}")
    source, failures = Source(package), 0
    for description, function in checks(source):
        try:
            function()
            print(f"ok    {description}")
        except Exception as error:  # noqa: BLE001  (any error is a failed check, reported by name)
            failures += 1
            print(f"FAIL  {description}: {type(error).__name__}: {error}")
    print(f"{failures} of {len(checks(source))} checks failed" if failures else f"all {len(checks(source))} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
