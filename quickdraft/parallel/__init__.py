"""Tensor parallelism: the target split Megatron-style over N ranks (torch.distributed).

shard.py: which slice of each weight a rank holds, shard-wise loading, the all-reduce modules;
group.py: the process group (spawned workers or torchrun), timeouts, RankFailure;
runtime.py: rank 0's TensorParallelTarget (a drop-in target for the engine) and the loop the
other ranks follow.
"""

from .group import DEFAULT_TIMEOUT_S, RankFailure
from .runtime import TensorParallelTarget, load_tensor_parallel
from .shard import LM_HEAD_MODES, ShardPlan, check_tensor_parallel

__all__ = ["DEFAULT_TIMEOUT_S", "LM_HEAD_MODES", "RankFailure", "ShardPlan", "TensorParallelTarget",
           "check_tensor_parallel", "load_tensor_parallel"]
