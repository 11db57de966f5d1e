"""pretrain/checkpoint/safe_load.py: checkpoints load without running code from them.

A file carrying a malicious global (an object whose __reduce__ calls os.system) is refused by
every reader of this project (the safe loader itself, our checkpoint reader, the HF `.bin`
reader, the Megatron-LM reader), naming the global, and the command never runs. The types real
checkpoints need (RNG states with numpy arrays, Megatron's `args` with Megatron's own enums)
load.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
import pytest
import torch
from megatron.core.transformer.enums import AttnBackend

from pretrain.checkpoint import safe_load
from pretrain.errors import UserError


class _Payload:
    """Unpickling this calls os.system: what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile(path, marker) -> str:
    torch.save({"module": {"w": torch.ones(2)}, "extra": _Payload(marker)}, path)
    return str(path)


def test_a_malicious_global_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = _hostile(tmp_path / "evil.pt", marker)
    with pytest.raises(UserError, match=r"evil\.pt: refused to load: .*(posix|os)\.system"):
        safe_load.load(path)
    with pytest.raises(UserError, match=r"refused to load"):
        safe_load.load(path, megatron=True, deepspeed=True)  # no allowlist lets it through
    assert not marker.exists()
    # the payload is real: the unrestricted unpickler runs it (what this module prevents)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_every_reader_refuses_it(tmp_path):
    """Our checkpoint reader, the HF .bin reader and the Megatron-LM reader all use safe_load."""
    from pretrain.convert.checkpoint_writer import write_checkpoint
    from pretrain.convert.megatron import read_megatron_checkpoint
    from pretrain.model import GPTModel, ModelConfig

    marker = tmp_path / "pwned"
    config = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16)
    ours = write_checkpoint(str(tmp_path / "ours"), GPTModel(config).state_dict(), config)
    _hostile(os.path.join(ours, "global_step0", "mp_rank_00_model_states.pt"), marker)
    from pretrain.convert.checkpoint_reader import read_checkpoint

    with pytest.raises(UserError, match="refused to load"):
        read_checkpoint(ours)

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16})
    )
    _hostile(hf / "pytorch_model.bin", marker)
    from pretrain.convert.hf_folder import read_hf_folder

    with pytest.raises(UserError, match="refused to load"):
        read_hf_folder(str(hf))

    megatron = tmp_path / "megatron"
    (megatron / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("1")
    _hostile(megatron / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", marker)
    with pytest.raises(UserError, match="refused to load"):
        read_megatron_checkpoint(str(megatron))
    assert not marker.exists()


def test_rng_states_and_megatron_args_load(tmp_path):
    random.seed(3)
    np.random.seed(3)
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    torch.save(state, tmp_path / "rng.pt")
    loaded = safe_load.load(str(tmp_path / "rng.pt"))
    np.random.set_state(loaded["numpy"])
    random.setstate(loaded["python"])
    assert np.random.randint(1 << 30) == np.random.RandomState(3).randint(1 << 30)

    args = argparse.Namespace(
        num_layers=2, params_dtype=torch.bfloat16, attention_backend=AttnBackend.auto
    )
    torch.save({"args": args, "checkpoint_version": 3.0}, tmp_path / "megatron.pt")
    # only where Megatron's types are expected, although importing megatron.core (above) has
    # added argparse.Namespace to torch's process-wide allowlist
    assert argparse.Namespace in torch.serialization.get_safe_globals()
    with pytest.raises(UserError, match="argparse.Namespace"):
        safe_load.load(str(tmp_path / "megatron.pt"))
    loaded = safe_load.load(str(tmp_path / "megatron.pt"), megatron=True)["args"]
    assert loaded.num_layers == 2 and loaded.params_dtype == torch.bfloat16
    # Megatron's enum is not imported: an inert stand-in records its name and value
    assert isinstance(loaded.attention_backend, safe_load.ForeignValue)
    assert loaded.attention_backend.qualified_name == "megatron.core.transformer.enums.AttnBackend"
    assert loaded.attention_backend.args == (AttnBackend.auto.value,)


def test_damaged_file(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"bad\.pt: cannot be read"):
        safe_load.load(str(tmp_path / "bad.pt"))


class _Plain:
    """A class outside every allowlist, harmless to unpickle."""

    def __init__(self, value):
        self.value = value


def test_checked_torch_loads_checks_the_calling_thread_only(tmp_path):
    """Inside `checked_torch_loads` this thread's torch.load refuses a foreign class, while
    another thread (as the background checkpoint writer) loads the same file with torch's own
    load meanwhile; afterwards torch.load is torch's again."""
    import threading

    path = str(tmp_path / "plain.pt")
    torch.save({"obj": _Plain(7)}, path)
    inside, done, seen = threading.Event(), threading.Event(), {}

    def other_thread():
        inside.wait(timeout=60)
        try:
            seen["value"] = torch.load(path, weights_only=False)["obj"].value
        except UserError as err:
            seen["value"] = err
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    original = torch.load
    with safe_load.checked_torch_loads():
        inside.set()
        assert done.wait(timeout=60)
        with pytest.raises(UserError, match=r"plain\.pt: refused to load: .*_Plain"):
            torch.load(path, weights_only=False)
    thread.join()
    assert seen["value"] == 7
    assert torch.load is original
