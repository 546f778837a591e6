"""Training methods (sft, dpo, rm, grpo, ppo): one `Method` record each, which `posttrain train`,
`posttrain compile`, `posttrain sweep` and the notebooks read (see `_record.py`)."""

from posttrain.methods._compile import compile_plan, lowering, remat_sweep, smallest_fit
from posttrain.methods._record import (
    METHODS,
    Method,
    config_domains,
    get,
    method_config,
    run_from_config,
)

__all__ = [
    "METHODS",
    "Method",
    "compile_plan",
    "config_domains",
    "get",
    "lowering",
    "method_config",
    "remat_sweep",
    "run_from_config",
    "smallest_fit",
]
