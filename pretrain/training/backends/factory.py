"""Which backend a run gets: the one place that names both, so the interface
(`pretrain.training.engine`) imports neither."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pretrain.training.engine import Engine


def build_engine(**kwargs) -> Engine:
    """The engine of the backend the run's `ParallelConfig` names (`parallel.backend`), built
    from the keyword arguments of `pretrain.training.backends.deepspeed.engine.
    build_deepspeed_engine` (the torch backend takes the ones it needs)."""
    if kwargs["parallel"].backend == "torch":
        from pretrain.training.backends.torch.engine import build_torch_engine

        return build_torch_engine(**kwargs)
    from pretrain.training.backends.deepspeed.engine import build_deepspeed_engine

    return build_deepspeed_engine(**kwargs)
