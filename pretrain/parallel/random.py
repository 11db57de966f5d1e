"""Randomness that does not depend on the parallel layout, and dropout that must.

Initialisation: every parameter's FULL (TP=1) value is drawn from its own generator, seeded by
(seed, the parameter's layout-independent name), and each rank keeps its shard. So TP=k and any
pipeline split start from exactly the TP=1 weights, whatever order the parts are built in.

Dropout: outside tensor-parallel regions (embeddings, residual stream) every TP rank must drop the
same elements, so those use the default generator, seeded identically on TP peers. Inside a TP
region (attention probabilities, which each rank holds for different heads) the masks must differ
per rank: `tensor_parallel_rng()` swaps in a generator seeded with seed + 2718 + tp_rank, as
Megatron does. `checkpoint` replays both generators when activations are recomputed.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import random

import numpy as np
import torch
import torch.utils.checkpoint

from pretrain.parallel import state
from pretrain.parallel.sharding import is_tensor_parallel, shard_tensor

TENSOR_PARALLEL_SEED_OFFSET = 2718
PIPELINE_SEED_STRIDE = 100


def _device_rng():
    """(get_state, set_state, manual_seed) of the generator dropout uses on this machine."""
    if torch.cuda.is_available():
        return torch.cuda.get_rng_state, torch.cuda.set_rng_state, torch.cuda.manual_seed
    return torch.get_rng_state, torch.set_rng_state, torch.manual_seed


class TensorParallelRNG:
    """The per-TP-rank dropout generator state, swapped in around TP-region dropout."""

    def __init__(self) -> None:
        self._state: torch.Tensor | None = None

    def seed(self, seed: int) -> None:
        get_state, set_state, manual_seed = _device_rng()
        outer = get_state()
        manual_seed(seed)
        self._state = get_state()
        set_state(outer)

    def get_state(self) -> torch.Tensor | None:
        return None if self._state is None else self._state.clone()

    def set_state(self, rng_state: torch.Tensor | None) -> None:
        self._state = rng_state

    @contextlib.contextmanager
    def fork(self):
        """Run the body with the TP generator as the default one; advance it, restore the outer."""
        if self._state is None:  # never seeded: one process, or the caller did not ask for TP seeds
            self.seed(
                torch.initial_seed()
                + TENSOR_PARALLEL_SEED_OFFSET
                + state.get_tensor_model_parallel_rank()
            )
        get_state, set_state, _ = _device_rng()
        outer = get_state()
        set_state(self._state)
        try:
            yield
        finally:
            self._state = get_state()
            set_state(outer)

    def replay(self, rng_state: torch.Tensor | None) -> _Replay:
        """Context manager: run the body from a saved state, then put the current state back (for
        recomputation); it can be entered again (the zero-bubble schedules recompute a
        checkpointed block twice, for the input and for the weight gradients)."""
        return _Replay(self, rng_state)


class _Replay:
    """`TensorParallelRNG.replay`: each `with` runs from the same saved state."""

    def __init__(self, rng: TensorParallelRNG, rng_state: torch.Tensor | None):
        self.rng, self.rng_state, self.outer = rng, rng_state, []

    def __enter__(self) -> None:
        self.outer.append(self.rng.get_state())
        self.rng.set_state(self.rng_state)

    def __exit__(self, *exc) -> None:
        self.rng.set_state(self.outer.pop())


_TP_RNG = TensorParallelRNG()


def get_tensor_parallel_rng() -> TensorParallelRNG:
    """The process's TP dropout generator (its state goes into checkpoints)."""
    return _TP_RNG


def tensor_parallel_rng():
    """Context manager: dropout inside a TP region (differs per TP rank, same across DP)."""
    return _TP_RNG.fork()


def seed_everything(seed: int) -> int:
    """Megatron's seeding: seed + 100 * pp_rank for the default generators (identical on TP and DP
    peers), seed' + 2718 + tp_rank for TP-region dropout. Returns seed'."""
    stage_seed = seed + PIPELINE_SEED_STRIDE * state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    _TP_RNG.seed(stage_seed + TENSOR_PARALLEL_SEED_OFFSET + state.get_tensor_model_parallel_rank())
    return stage_seed


_RECOMPUTING = contextvars.ContextVar("recomputing", default=False)


def is_recomputing() -> bool:
    """True while `checkpoint` recomputes a forward pass in backward: code with side effects that
    must happen once per forward (counting routed tokens) skips them then."""
    return _RECOMPUTING.get()


class _Recomputation:
    """The recomputation context of `checkpoint`: the saved TP generator state and
    `is_recomputing()` true; like `_Replay` it can be entered again (zero-bubble schedules recompute
    a block twice)."""

    def __init__(self, saved: torch.Tensor | None):
        self.replay, self.tokens = _TP_RNG.replay(saved), []

    def __enter__(self) -> None:
        self.tokens.append(_RECOMPUTING.set(True))
        self.replay.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self.replay.__exit__(*exc)
        finally:
            _RECOMPUTING.reset(self.tokens.pop())


def checkpoint(function, *args):
    """Activation checkpointing whose recomputation sees the same dropout masks (both generators)
    and knows it is one (`is_recomputing`)."""
    saved = _TP_RNG.get_state()

    def contexts():
        return contextlib.nullcontext(), _Recomputation(saved)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=contexts
    )


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one named parameter; stable across processes, layouts and Python runs."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


ROWS_PER_DRAW = 64


def draw_full_normal(
    shape: list[int] | torch.Size, name: str, seed: int, std: float
) -> torch.Tensor:
    """The full fp32 N(0, std) tensor for parameter `name`, drawn on the CPU.

    Rows (dim 0) are drawn in blocks of ROWS_PER_DRAW, each from its own generator, so a row's value
    does not depend on how many rows there are: the true vocabulary rows of an embedding are the same
    whatever the padding (which grows with TP).
    """
    rows, rest = (shape[0], list(shape[1:])) if len(shape) > 0 else (1, [])
    blocks = []
    for start in range(0, rows, ROWS_PER_DRAW):
        generator = torch.Generator().manual_seed(parameter_seed(seed, f"{name}#{start}"))
        block = torch.empty([ROWS_PER_DRAW] + rest, dtype=torch.float32).normal_(
            0.0, std, generator=generator
        )
        blocks.append(block[: min(ROWS_PER_DRAW, rows - start)])
    return torch.cat(blocks).reshape(shape)


@torch.no_grad()
def init_normal_(
    param: torch.Tensor, name: str, seed: int, std: float, real_rows: int | None = None
) -> torch.Tensor:
    """Fill `param` with its TP shard of the full N(0, std) tensor drawn for `name`.

    The full tensor is drawn in fp32 on the CPU (so CPU and GPU runs agree), then sharded and cast.
    `real_rows` (a padded vocabulary's true size): only rows [0, real_rows) are drawn, exactly as
    in an unpadded tensor, and the padding rows after them are zeros, so neither the real rows nor
    the padding depend on how much padding there is (which grows with TP).
    """
    world = state.get_tensor_model_parallel_world_size() if is_tensor_parallel(param) else 1
    shape = list(param.shape)
    if world > 1:
        shape[param.partition_dim] *= world
    if real_rows is None:
        full = draw_full_normal(shape, name, seed, std)
    else:
        if not 0 < real_rows <= shape[0]:
            raise ValueError(f"{name}: real_rows {real_rows} not in (0, {shape[0]}]")
        full = torch.zeros(shape, dtype=torch.float32)
        full[:real_rows] = draw_full_normal([real_rows] + shape[1:], name, seed, std)
    if world > 1:
        full = shard_tensor(
            full,
            param.partition_dim,
            state.get_tensor_model_parallel_rank(),
            world,
            param.partition_stride,
        )
    return param.copy_(full)
