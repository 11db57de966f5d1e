"""Two races seen under load in tests/test_checkpoint_reliability.py and tests/test_preemption.py,
pinned here without timing: an error line is one write (two ranks' lines on one pipe stayed
separate lines), and a rank whose run stopped for the exit signal is not killed by the launcher
watch when the launcher dies during its exit save or teardown."""

from __future__ import annotations

import io
import sys

import pytest

from pretrain.errors import UserError, print_user_error
from pretrain.training.loop import exit_signal
from pretrain.training.loop.exit_signal import ExitSignal


class _Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.calls = []

    def write(self, text):
        self.calls.append(text)
        return super().write(text)


def test_an_error_line_is_one_write(monkeypatch):
    stream = _Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    print_user_error(UserError("--load ckpt: no complete checkpoint"))
    assert stream.calls == ["error: --load ckpt: no complete checkpoint\n"]


@pytest.mark.parametrize("other_rank_signalled", [True, False])
def test_the_launcher_gone_after_the_loop(monkeypatch, other_rank_signalled):
    """Inside the block the launcher's death counts as the signal. After it: True (the rank
    ends by itself) only if the run stopped for the signal, which a rank that did not receive
    it learns from `requested()` (the all-reduce, stood in for by the other rank's answer)."""
    monkeypatch.setattr(exit_signal, "any_rank", lambda flag: flag or other_rank_signalled)
    with ExitSignal() as handler:
        assert handler.requested() is other_rank_signalled
    assert handler.count() is other_rank_signalled
    with ExitSignal() as handler:
        assert handler.count() is True and handler.received


def test_a_signal_after_the_all_reduce_waits_for_the_next_one(monkeypatch):
    """The signal lands on this rank just after the all-reduce said no: this iteration's answer
    stays the all-reduce's (the other ranks got False too), the next one says yes everywhere."""
    handler = ExitSignal()

    def all_reduce_then_signal(flag):
        handler.received = True  # the handler runs right after the collective returned
        return flag

    monkeypatch.setattr(exit_signal, "any_rank", all_reduce_then_signal)
    with handler:
        assert handler.requested() is False
        assert handler.requested() is True
