"""`PREFIX.lock` (pretrain/data/files/output_lock.py): a finished writer deletes it while holding it, and
the deletion never lets two runs hold the lock, nor deletes another run's lock file."""

import os

import pytest

import pretrain.data.files.output_lock as output_lock
from pretrain.data.files.output_lock import lock_output
from pretrain.errors import UserError


def _refused(prefix):
    with pytest.raises(UserError, match="another run is writing"):
        lock_output(prefix)


def test_a_writer_removes_its_lock_file_and_the_prefix_is_free_again(tmp_path):
    prefix = str(tmp_path / "out")
    held = lock_output(prefix)
    _refused(prefix)
    held.remove()
    assert not os.path.exists(prefix + ".lock")
    lock_output(prefix).remove()


def test_remove_never_deletes_another_runs_lock_file(tmp_path):
    prefix = str(tmp_path / "out")
    first = lock_output(prefix)
    os.remove(prefix + ".lock")  # someone deleted it by hand; a second run takes a new one
    second = lock_output(prefix)
    first.remove()
    assert os.path.exists(prefix + ".lock")  # the second run's file stays
    _refused(prefix)  # and it still holds it
    second.remove()


def test_a_lock_file_removed_while_being_taken_is_not_held(tmp_path, monkeypatch):
    """Run B opens PREFIX.lock just as run A, finished, deletes it and lets go: B must not end up
    holding the deleted file (a run C would then hold the new one at the same time)."""
    prefix = str(tmp_path / "out")
    finishing = lock_output(prefix)
    real = output_lock.FileLock

    class RacingLock(real):
        def acquire(self, *args, **kwargs):
            if finishing is not None and os.path.exists(prefix + ".lock"):
                finished()
            return super().acquire(*args, **kwargs)

    def finished():
        nonlocal finishing
        finishing.remove()  # between B's look at the file and B's lock on it
        finishing = None

    monkeypatch.setattr(output_lock, "FileLock", RacingLock)
    taken = lock_output(prefix)
    monkeypatch.setattr(output_lock, "FileLock", real)
    # B holds the file now at the name: a third run is refused, not let in beside it
    _refused(prefix)
    taken.remove()
    assert not os.path.exists(prefix + ".lock")
