"""Run under torchrun: one lnfree run, then gather every rank's σ and weights into a JSON file (rank 0).

    torchrun --nproc_per_node=2 tests/dist_worker.py CONFIG.json RESULT.json [--natural-exit] [--fsdp | --fsdp-blocks]

--natural-exit ends the script as a user's would (no explicit teardown, no `exit_without_teardown`):
benchmarks/gloo_exit.py counts how often that aborts. --fsdp shards the run with FSDP2 (`shard_on_cpu`): the root
module alone (accelerate's default plugin), or with --fsdp-blocks each transformer block too (its
`transformer_based_wrap` policy over the model's `_no_split_modules`, as GPU users' accelerate configs set it).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lnfree.fixedscale import surgery
from lnfree.removal.config import RunConfig
from lnfree.removal.launch import close_distributed, exit_without_teardown
from lnfree.removal.train import run


def shard_on_cpu(blocks: bool) -> None:
    """Make the run's accelerator shard with FSDP2 on these gloo processes (each block in its own group where
    `blocks`). accelerate turns a CPU process group into DDP whatever its FSDP settings (`MULTI_CPU`), while FSDP2
    itself runs on gloo: set its shared state first."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    Accelerator(cpu=True)
    PartialState().distributed_type = DistributedType.FSDP  # the state a later Accelerator copies from
    AcceleratorState().distributed_type = DistributedType.FSDP
    wrap = {"auto_wrap_policy": "transformer_based_wrap"} if blocks else {}
    AcceleratorState().fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **wrap)


if {"--fsdp", "--fsdp-blocks"} & set(sys.argv[3:]):
    shard_on_cpu(blocks="--fsdp-blocks" in sys.argv[3:])
config = RunConfig.model_validate_json(open(sys.argv[1]).read())
result = run(config, progress=False)
sigmas = torch.stack([state.sigmas() for state in surgery.scale_states(result.model).values()])
gathered = [torch.zeros_like(sigmas) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, sigmas)
flags = [torch.zeros(len(surgery.scale_states(result.model))) for _ in range(dist.get_world_size())]
dist.all_gather(flags, torch.tensor([float(s.is_fixed) for s in surgery.scale_states(result.model).values()]))
full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in result.model.parameters()]  # FSDP2: DTensors
weights = torch.stack([p.detach().double().sum() for p in full])  # a fingerprint per tensor
gathered_weights = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
dist.all_gather(gathered_weights, weights)
events = [None] * dist.get_world_size()
dist.all_gather_object(events, result.events)
if dist.get_rank() == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"world_size": dist.get_world_size(), "backend": dist.get_backend(),
                   "sigmas": [g.tolist() for g in gathered], "fixed": [f.tolist() for f in flags],
                   "events": events, "held_out_ce_end": result.held_out_ce_end,
                   "weights": [w.tolist() for w in gathered_weights], "sharded": isinstance(result.model, FSDPModule),
                   "groups": [name for name, m in result.model.named_modules() if isinstance(m, FSDPModule)]}, f)
if "--natural-exit" not in sys.argv[3:]:
    close_distributed()
    exit_without_teardown(0)  # as `lnfree remove` ends a distributed run
