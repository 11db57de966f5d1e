"""Saving training: the backend's own files plus what they leave out, committed last.

The format (file names, tags, `latest`, metadata) is `pretrain.checkpoint.format`, the
file-system steps of the commit `pretrain.checkpoint.commit`, what "complete" means and which
step `--load` picks `pretrain.checkpoint.integrity`; this module adds the when
(`Checkpointer.should_save`) and the how for a live engine on every rank (any backend). Resuming is
`pretrain.training.checkpoints.resume`.

Save (docs/CHECKPOINTS.md, "Commit protocol"): every rank writes its backend's files and RNG
state into a hidden temporary folder, each file fsynced; the ranks agree that all writes
succeeded; rank 0 writes the metadata with every file's size, renames the folder into place and
replaces `latest`; a final agreement. A failure on any rank (a full disk) is one line on every
rank, the temporary folder is removed, and the previous checkpoint is untouched. A process
killed at any point leaves `latest` naming a complete checkpoint. A save whose weights or
optimizer state hold NaN/Inf on any rank writes nothing (one warning; `nonfinite_state`).

A stop never abandons a finished step (docs/RELIABILITY.md, "Stops and pending async saves"): a
background save (--async-save) was finite when staged, so before any stop it is committed:
`committed_before_stop` for the stops every rank takes together (a divergence, --exit-interval,
an exit signal), `wait` before a spike rewind, `committing_on_error` around the loop for an
exception.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import os
import random
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pretrain.atomic import atomic_write_bytes
from pretrain.checkpoint import fingerprints
from pretrain.checkpoint.agreement import position_stamp
from pretrain.checkpoint.commit import (
    StepInUse,
    commit_latest,
    directory_size,
    install_step,
    is_protected,
    latest_tag_or_none,
    new_unique,
    prune_steps,
    remove_stale_temporaries,
    write_failure_message,
)
from pretrain.checkpoint.format import (
    FILES_KEY,
    FINGERPRINTS_KEY,
    META_FILE,
    build_metadata,
    tag_for,
    temporary_name,
)
from pretrain.checkpoint.integrity import manifest, nonfinite_summary
from pretrain.errors import UserError
from pretrain.model.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.random import get_tensor_parallel_rng
from pretrain.testing_hooks import (
    SIGKILL_BEFORE_COMMIT,
    armed_save,
    kill_here,
    save_event,
    stream_watcher,
)
from pretrain.training.checkpoints.checkpoint_writes import BackgroundFiles, RankFiles, agree
from pretrain.training.distributed import any_rank
from pretrain.training.report.logging import logger
from pretrain.training.state import TrainState

if TYPE_CHECKING:
    from pretrain.training.engine import Engine


def nonfinite_state(engine: Engine) -> str | None:
    """This rank's first weight, optimizer-state or master tensor holding NaN/Inf, as
    `non-finite values (NaN/Inf) in <what> <name>[ (and N more)]`; None if all are finite."""
    for tree, what in engine.state_trees(with_optimizer=True):
        summary = nonfinite_summary(tree, what)
        if summary is not None:
            return summary
    return None


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where checkpoints go, how often, and what a resume restores (Megatron's flags)."""

    save: str | None = None
    """Folder to write checkpoints into (--save)."""
    load: str | None = None
    """Folder to resume from, at its `latest` (--load)."""
    save_interval: int | None = None
    """Save after every this many iterations (--save-interval)."""
    no_save_rng: bool = False
    """Do not save per-rank RNG states (--no-save-rng)."""
    no_save_full_state: bool = False
    """Do not save the layout-independent state (--no-save-full-state): smaller, faster saves
    that resume only at their own TP/PP/DP/ZeRO layout."""
    no_load_optim: bool = False
    """Resume weights and position but not the optimizer state (--no-load-optim)."""
    no_load_rng: bool = False
    """Do not restore RNG states (--no-load-rng)."""
    finetune: bool = False
    """Load weights only; iteration and data restart at 0 (--finetune)."""
    use_checkpoint_args: bool = False
    """The model flags were taken from the --load checkpoint (--use-checkpoint-args)."""
    override_opt_param_scheduler: bool = False
    """Resume with this run's LR schedule where the checkpoint's differs
    (--override-opt_param-scheduler; `scheduler_resume`)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """Resume with the checkpoint's LR schedule over this run's flags
    (--use-checkpoint-opt_param-scheduler; `scheduler_resume`)."""
    async_save: bool = False
    """Stage each save in memory and write it in the background; the commit (`latest`) follows
    when every rank's write has finished (--async-save; backends with `Engine.async_native`)."""
    save_total_limit: int | None = None
    """Keep the newest this many complete steps, deleting older ones after each commit
    (--save-total-limit); the step `latest` names is never deleted."""


def rng_state() -> dict:
    """This rank's python/numpy/torch/CUDA/TP-dropout generator states."""
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tensor_parallel": get_tensor_parallel_rng().get_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


STOP_SECONDS = 60
"""How long a rank that stopped with an exception waits for every other rank to stop too before
it gives a pending background save up (uncommitted: the other ranks went on, or died)."""


@dataclass
class _Pending:
    """A background save (--async-save) whose files are being written."""

    train_state: TrainState
    """A copy of the position it saves."""
    tmp_name: str
    unique: str
    files: RankFiles
    """Holds a failed write."""
    done: Future
    """Done when this rank's files are all written."""


def _bytes_needed(engine: Engine, save_dir: str) -> int:
    """The size of the checkpoint `latest` names, else this rank's weights' bytes (a lower bound)."""
    previous = latest_tag_or_none(save_dir)
    size = directory_size(os.path.join(save_dir, previous)) if previous else 0
    if size:
        return size
    return engine.weight_bytes()


class Checkpointer:
    """Decides when to save (`should_save`) and saves a live engine by the commit protocol.

    `run_record` is stored in every checkpoint's metadata beside the model and layout (the
    tokenizer, data and training settings, data fingerprints, argv), so a checkpoint says how it
    was made; `tokens_seen(consumed_samples)` adds the training tokens read per data prefix.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        model: ModelConfig,
        parallel: ParallelConfig,
        tokenizer: dict,
        run_record: dict,
        tokens_seen: Callable[[int], dict[str, int]] | None = None,
    ):
        self.config, self.model, self.parallel = config, model, parallel
        self.tokenizer, self.run_record = tokenizer, run_record
        self.tokens_seen = tokens_seen
        self.last_saved: int | None = None
        self._cleaned = False
        self._pending: _Pending | None = None  # a background save not yet committed
        # after an exception: are all ranks here? (a collective of the default group could meet
        # a rank still inside the step's collectives)
        self._stop_group = (
            torch.distributed.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=STOP_SECONDS)
            )
            if config.async_save and config.save
            else None
        )

    def should_save(self, iteration: int) -> bool:
        """True at every --save-interval iteration (with --save)."""
        c = self.config
        return bool(c.save and c.save_interval and iteration % c.save_interval == 0)

    def save_if_unsaved(self, engine: Engine, train_state: TrainState) -> None:
        """Save at exit unless this iteration was just saved (or --save is not given), and wait
        for a background save to be committed."""
        if self.config.save and self.last_saved != train_state.iteration:
            self.save(engine, train_state)
        self.wait(engine)

    def save(self, engine: Engine, train_state: TrainState) -> str | None:
        """Write the checkpoint for `train_state.iteration` on every rank and commit it; returns
        its tag, or None when the step `latest` names already has that tag (it is kept) or when
        the weights or optimizer state hold NaN/Inf on any rank (nothing is written). With
        --async-save the files are staged here and written in the background; `poll` or `wait`
        commits them (a background save still running is committed first)."""
        self.wait(engine)
        iteration = train_state.iteration
        with armed_save(iteration):
            if self._nonfinite(engine, iteration):
                self.last_saved = iteration
                return None
            unique = self._begin(iteration)
            self.last_saved = iteration
            if unique is None:
                return None
            tmp_name = temporary_name(tag_for(iteration), "tmp", unique)
            if self.config.async_save:
                self._pending = self._start_background(engine, train_state, tmp_name, unique)
                return tag_for(iteration)
            files = RankFiles()
            self._write_rank_files(engine, train_state, tmp_name, files)
            self._conclude(engine, train_state, tmp_name, unique, files)
        return tag_for(iteration)

    def poll(self, engine: Engine) -> None:
        """At an iteration's end: commit the background save if every rank has written its
        files (a collective while one runs; nothing otherwise)."""
        if self._pending is not None and not any_rank(not self._pending.done.done()):
            self._finish(engine)

    def wait(self, engine: Engine) -> None:
        """Wait for the background save (if one runs) to be written on every rank; commit it."""
        if self._pending is not None:
            self._pending.done.result()
            self._finish(engine)

    def committed_before_stop(self, engine: Engine) -> str | None:
        """Before a stop every rank takes at the same point: commit the background save (it was
        finite when staged), waiting for its writes; return the step a relaunch resumes from
        (`newest_checkpoint`). A failed commit is one warning and the stop goes on. A
        collective while a background save runs."""
        try:
            self.wait(engine)
        except UserError as err:
            logger.warning(f"WARNING: {err}")
        return self.newest_checkpoint()

    @contextlib.contextmanager
    def committing_on_error(self, engine: Engine):
        """Around the training loop: an exception on every rank (within `STOP_SECONDS` of each
        other) commits the pending background save before it goes on; on some ranks only, the
        save stays uncommitted (one warning; the next run removes its temporary folder)."""
        try:
            yield
        except Exception:
            if self._pending is not None:
                self._commit_after_error(engine)
            raise

    def _commit_after_error(self, engine: Engine) -> None:
        """`committing_on_error`'s commit: once every rank has met on the stop group (the default
        group may hold a rank still inside the step), the usual wait and commit."""
        iteration = self._pending.train_state.iteration
        try:
            torch.distributed.all_reduce(torch.ones(1), group=self._stop_group)
            self.wait(engine)
        except (RuntimeError, UserError) as err:
            self._pending = None
            logger.warning(
                f"WARNING: the background save of iteration {iteration} is not committed after "
                f"the error below: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            )

    def _start_background(
        self, engine: Engine, train_state: TrainState, tmp_name: str, unique: str
    ) -> _Pending:
        """Stage this rank's files (copies: training goes on) and start writing them."""
        files = BackgroundFiles(stream_watcher())
        native = self._write_rank_files(engine, train_state, tmp_name, files, background=True)
        done = files.start(after=native, where=os.path.join(self.config.save, tmp_name))
        logger.info(
            f"staged checkpoint at iteration {train_state.iteration:8d}; writing it in the "
            f"background (--async-save)"
        )
        return _Pending(copy.deepcopy(train_state), tmp_name, unique, files, done)

    def _finish(self, engine: Engine) -> None:
        """Commit the background save, whose files every rank has written."""
        pending, self._pending = self._pending, None
        with armed_save(pending.train_state.iteration):
            self._conclude(
                engine, pending.train_state, pending.tmp_name, pending.unique, pending.files
            )

    def _conclude(
        self,
        engine: Engine,
        train_state: TrainState,
        tmp_name: str,
        unique: str,
        files: RankFiles,
    ) -> None:
        """The ranks agree that every write succeeded, rank 0 commits, they agree again; a
        failure on any rank is one UserError on every rank (the temporary folder removed)."""
        failure = agree(self._failure_line(engine, files))
        if failure is None:  # (agreeing on an agreed failure again would name the rank twice)
            if torch.distributed.get_rank() == 0:
                failure = self._commit(engine, train_state, tmp_name, unique)
            failure = agree(failure)
        if failure is not None:
            if torch.distributed.get_rank() == 0:
                shutil.rmtree(os.path.join(self.config.save, tmp_name), ignore_errors=True)
            raise UserError(failure)
        iteration = train_state.iteration
        logger.info(
            f"saved checkpoint at iteration {iteration:8d} to "
            f"{os.path.join(self.config.save, tag_for(iteration))}"
        )
        limit = self.config.save_total_limit
        if limit and torch.distributed.get_rank() == 0:  # only after a newer step committed
            for removed in prune_steps(self.config.save, limit):
                logger.info(
                    f"removed {os.path.join(self.config.save, removed)} (--save-total-limit)"
                )

    def newest_checkpoint(self) -> str | None:
        """The step a relaunch would resume from: the one `latest` names in --save, else in
        --load; None without either (or before the first save)."""
        for folder in (self.config.save, self.config.load):
            tag = latest_tag_or_none(folder) if folder else None
            if tag is not None:
                return os.path.join(folder, tag)
        return None

    def _nonfinite(self, engine: Engine, iteration: int) -> bool:
        """Whether any rank's weights or optimizer state hold NaN/Inf: then nothing is written
        and rank 0 says so in one warning line (every rank gets the same answer)."""
        problem = agree(nonfinite_state(engine))
        if problem is None:
            return False
        if torch.distributed.get_rank() == 0:
            kept = self.newest_checkpoint()
            logger.warning(
                f"WARNING: not saving iteration {iteration}: {problem} (the run diverged); "
                + (f"the last checkpoint, {kept}, is kept" if kept else "no checkpoint is kept")
            )
        return True

    def _begin(self, iteration: int) -> str | None:
        """Rank 0 prepares the folder and names the save's temporary folder (None: skip);
        every rank gets the same answer."""
        save_dir = self.config.save
        decision: list[str | None] = [None]
        if torch.distributed.get_rank() == 0:
            try:
                os.makedirs(save_dir, exist_ok=True)
            except OSError as err:
                decision = [f"!--save {save_dir}: cannot create it ({err.strerror or err})"]
            else:
                decision = self._decide(iteration)
        torch.distributed.broadcast_object_list(decision, src=0)
        if decision[0] is not None and decision[0].startswith("!"):
            raise UserError(decision[0][1:])
        return decision[0]

    def _decide(self, iteration: int) -> list[str | None]:
        """Rank 0: [the save's unique id], or [None] to keep the step `latest` names."""
        save_dir, tag = self.config.save, tag_for(iteration)
        if not self._cleaned:
            self._cleaned = True
            for name in remove_stale_temporaries(save_dir):
                logger.info(f"removed {os.path.join(save_dir, name)} (left by a killed save)")
        if is_protected(save_dir, tag):
            logger.warning(
                f"WARNING: not saving iteration {iteration}: {os.path.join(save_dir, tag)} is "
                f"the complete checkpoint `latest` names (from an earlier run) and is kept; "
                f"use another --save directory to keep this run's weights"
            )
            return [None]
        return [new_unique()]

    def _write_rank_files(
        self,
        engine: Engine,
        train_state: TrainState,
        tmp_name: str,
        files: RankFiles,
        background: bool = False,
    ) -> Future | None:
        """This rank's backend files, RNG state and (unless --no-save-full-state) part of the
        layout-independent state, each fsynced, through `files` (failures kept there);
        `background`: the backend's files staged and written in the background (their
        future)."""
        save_dir = self.config.save
        client_state = dataclasses.asdict(train_state)
        native = None
        if background:
            native = engine.save_native_in_background(save_dir, tmp_name, client_state, files)
        else:
            engine.save_native(save_dir, tmp_name, client_state, files)
        stamp = position_stamp(train_state.iteration, train_state.consumed_train_samples)
        if not self.config.no_save_rng:
            rank = torch.distributed.get_rank()
            path = os.path.join(save_dir, tmp_name, f"rng_state_{rank}.pt")
            files.write({**rng_state(), **stamp}, path)
        if not self.config.no_save_full_state:
            step_dir = os.path.join(save_dir, tmp_name)
            engine.save_full_state(step_dir, files.write, stamp)  # a collective
        return native

    def _failure_line(self, engine: Engine, files: RankFiles) -> str | None:
        """The one line of this rank's failed write, or None."""
        if files.failure is None:
            return None
        path, reason = files.failure
        save_dir = self.config.save
        return write_failure_message(path, reason, save_dir, _bytes_needed(engine, save_dir))

    def _commit(
        self, engine: Engine, train_state: TrainState, tmp_name: str, unique: str
    ) -> str | None:
        """Rank 0: metadata with the file list, rename into place, commit `latest`; a failure
        as one line."""
        save_dir, iteration = self.config.save, train_state.iteration
        tag, tmp_dir = tag_for(iteration), os.path.join(save_dir, tmp_name)
        kill_here(SIGKILL_BEFORE_COMMIT, iteration)
        meta = build_metadata(
            iteration=iteration,
            consumed_train_samples=train_state.consumed_train_samples,
            consumed_valid_samples=train_state.consumed_valid_samples,
            skipped_train_samples=train_state.skipped_train_samples,
            spike_loss_window=train_state.spike_loss_window,
            spike_pending_skips=train_state.spike_pending_skips,
            data_mixture=train_state.data_mixture,
            model=self.model,
            parallel=self.parallel,
            pipeline_engine=engine.pipeline,
            tokenizer=self.tokenizer,
            deepspeed_config=engine.config_record(),
            tokens_seen=(
                None
                if self.tokens_seen is None
                else self.tokens_seen(train_state.consumed_train_samples)
            ),
            full_state=not self.config.no_save_full_state,
            **self.run_record,
        )
        meta[FILES_KEY] = manifest(tmp_dir)
        try:
            meta[FINGERPRINTS_KEY] = fingerprints.record(tmp_dir, meta[FILES_KEY])
            atomic_write_bytes(
                os.path.join(tmp_dir, META_FILE), json.dumps(meta, indent=2, default=str).encode()
            )
            save_event("metadata written")
            install_step(save_dir, tmp_name, tag, unique)
            commit_latest(save_dir, tag)
        except OSError as err:
            return write_failure_message(
                err.filename or save_dir,
                err.strerror or str(err),
                save_dir,
                _bytes_needed(engine, save_dir),
            )
        except StepInUse as err:
            return f"{err}: `latest` names it; not replaced (another run writes into --save?)"
        return None
