"""Run a function on N real gloo ranks (spawned processes) with a hard timeout.

    from distributed import run_on_ranks
    results = run_on_ranks(check_something, world_size=4, args=(1, 2), timeout=90)

`fn(rank, world_size, *args)` must be a module-level (picklable) function; it runs after
`torch.distributed.init_process_group("gloo")` with OMP_NUM_THREADS=1 and returns a picklable
value (tensors are copied). `run_on_ranks` returns the per-rank results in rank order, or raises
`AssertionError` carrying the failing rank's traceback, or `TimeoutError` (all ranks killed) when
the world does not finish in `timeout` seconds (e.g. a collective that never matches).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback

import launch_guard

from pretrain.launch import free_port


def _worker(fn, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
        )
        value = fn(rank, world_size, *args)
        # plain pickle copies tensors by value (no shared-memory handles that die with this process)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report anything, including assertion failures, to the parent
        # report before tearing the group down: peers then fail with "connection closed", later
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer")


def _root_cause(failures: list[tuple[int, str]]) -> tuple[int, str]:
    """The first failure that is not just a peer's disappearance."""
    for rank, trace in failures:
        if not any(symptom in trace for symptom in _PEER_SYMPTOMS):
            return rank, trace
    return failures[0]


def run_on_ranks(fn, world_size: int, args: tuple = (), timeout: float = 120.0) -> list:
    """`fn` on `world_size` spawned gloo ranks (the module docstring); only in a `slow` test."""
    launch_guard.check(f"run_on_ranks({fn.__name__}, world_size={world_size})")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(
            target=_worker, args=(fn, rank, world_size, port, args, results), daemon=True
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcome: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s; "
                    f"ranks without a result: {sorted(set(range(world_size)) - set(outcome))}"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in outcome and p.exitcode not in (None, 0)
                ]
                if dead:
                    raise AssertionError(
                        f"rank {dead[0]} of {fn.__name__} died with exit code "
                        f"{procs[dead[0]].exitcode} before reporting"
                    ) from None
                continue
            if not ok:
                failures = [(rank, payload)]
                # let the other ranks' reports arrive, to find the cause
                grace = time.monotonic() + 2.0
                while len(failures) + len(outcome) < world_size and time.monotonic() < grace:
                    try:
                        other_rank, other_ok, other_payload = results.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    if not other_ok:
                        failures.append((other_rank, other_payload))
                rank, trace = _root_cause(failures)
                others = sorted(r for r, _ in failures if r != rank)
                also = f" (ranks {others} failed too)" if others else ""
                raise AssertionError(
                    f"rank {rank} of {world_size} failed in {fn.__name__}{also}:\n{trace}"
                )
            outcome[rank] = pickle.loads(payload)
        finished = True
    finally:
        for proc in procs:  # after a failure the other ranks may wait in a collective: end them now
            proc.join(timeout=10 if finished else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [outcome[rank] for rank in range(world_size)]
