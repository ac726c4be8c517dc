"""Several devices: tensor parallel over ``torch.distributed`` (see ``launch`` and ``sharding``)."""
from __future__ import annotations

from .launch import DEFAULT_STEP_TIMEOUT, TensorParallelError, TensorParallelModel, load_tensor_parallel
from .sharding import ShardingError

__all__ = ["DEFAULT_STEP_TIMEOUT", "ShardingError", "TensorParallelError", "TensorParallelModel", "load_tensor_parallel"]
