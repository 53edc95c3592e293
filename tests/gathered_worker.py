"""Run by tests/test_gathered_decoding.py as its own program, once per rank (2 gloo processes on the CPU).

    python tests/gathered_worker.py OUT_DIR {fsdp1|fsdp2} RANK PORT

Shards the packaged tiny student (its decoder layers, then the whole model) with FSDP1 or FSDP2, decodes the
same prompts greedily three ways and writes ``OUT_DIR/rank<r>.json``: the all-gathers each decode issued
(torch.distributed's all-gather entry points, counted), the texts, and the texts of the unsharded model."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.models.pruning import decoder_layers
from kdlab.rollouts.decoding import sample_completions
from kdlab.stages.sharding import gathered_for_decoding, shard_fsdp2
from kdlab.tasks import Addition

STUDENT = "kdlab://tiny-random/student"


def count_all_gathers() -> list[int]:
    calls = [0]
    for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather"):  # FSDP2, FSDP1
        original = getattr(dist, name, None)
        if original is not None:
            def counted(*args, _original=original, **kwargs):
                calls[0] += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
    return calls


def main(out: Path, layout: str, rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    spec = ModelSpec(STUDENT)
    tokenizer, plain = load_tokenizer(spec, "student"), load_causal_lm(spec, "student").eval()
    model = load_causal_lm(spec, "student").eval()
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        shard_fsdp2([model], init_device_mesh("cpu", (2,)), "32-true")
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        cpu = torch.device("cpu")
        _, _, layers = decoder_layers(model)
        for index in range(len(layers)):
            layers[index] = FullyShardedDataParallel(layers[index], device_id=cpu)
        model = FullyShardedDataParallel(model, device_id=cpu)
    task = Addition(num_train=4)
    examples = task.examples("train")
    calls = count_all_gathers()

    def all_done(done: bool) -> bool:
        flag = torch.tensor([0 if done else 1])
        dist.all_reduce(flag)
        return int(flag) == 0

    settings = {"max_new_tokens": 12, "batch_size": 4, "all_done": all_done, "device": torch.device("cpu")}
    texts, counts = {}, {}
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # lazy initialisation, outside the counts
        for name, block in (("each_token", None), ("gathered", gathered_for_decoding), ("after", None)):
            start = calls[0]
            if block is None:
                texts[name] = sample_completions(model, tokenizer, task, examples, **settings)
            else:
                with block([model]):
                    texts[name] = sample_completions(model, tokenizer, task, examples, **settings)
            counts[name] = calls[0] - start
        texts["unsharded"] = sample_completions(plain, tokenizer, task, examples, max_new_tokens=12, batch_size=4)
    units = sum(1 for unit in model.modules() if type(unit).__name__.startswith(("FSDP", "FullyShardedDataParallel")))
    (out / f"rank{rank}.json").write_text(json.dumps({"counts": counts, "texts": texts, "units": units}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
