"""One gloo process (world size 1): the tiny student sharded with FSDP2 decodes with :class:`StaticCacheLM` (a
sampled decode of 8 tokens), then trains on what it decoded (a forward and a backward). ``python
inference_mode_worker.py PORT [force]``: ``force`` sets the decoder's ``inference`` to True whatever the model is,
as a decoder that did not tell sharded models apart would. Prints ``inference`` and ``backward ok``."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from kdlab.models import ModelSpec, load_causal_lm
from kdlab.rollouts.decoding import sample_tokens
from kdlab.rollouts.static_cache import StaticCacheLM

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
model = load_causal_lm(ModelSpec("kdlab://tiny-random/student", dtype="float32"), "student")
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
ids = torch.randint(5, 300, (2, 20), generator=torch.Generator().manual_seed(0))
model.eval()
decoder = StaticCacheLM(model, ids, torch.ones_like(ids), 353, 1.0, 8)
if "force" in sys.argv[2:]:
    decoder.inference = True
print("inference", decoder.inference)
tokens, _, _ = sample_tokens(decoder, 2, 8, (-1,), 0, torch.Generator().manual_seed(0))
model.train()
logits = model(input_ids=torch.cat([ids, tokens], 1)).logits
logits.float().logsumexp(-1).mean().backward()
print("backward ok", sum(parameter.grad is not None for parameter in model.parameters()))
dist.destroy_process_group()
