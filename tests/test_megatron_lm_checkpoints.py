"""tools/convert_from_megatron.py on checkpoints written by Megatron-LM main's own training code.

The fixtures under tests/fixtures/megatron_lm/ were made by make_checkpoints.py there: Megatron-LM
main's `pretrain_gpt.py` trained a tiny GPT-2-style and a Llama-style model for 3 iterations on
one CPU gloo rank and wrote them with its own `save_checkpoint` (`--ckpt-format torch`), with and
without `--no-save-optim`, and the Llama one in Megatron-LM's default `--ckpt-format torch_dist`
(main keeps args etc. as one `common_state` object inside the .distcp files); right after saving, Megatron's own GPTModel computed the logits of a
fixed batch (NAME.reference.pt) and the generator recorded the model's args (NAME.args.json).
Each file's saved `args` holds what Megatron-LM main really pickles: `signal.Signals`
(exit_signal), megatron-core enums (AttnBackend, InferenceCudaGraphScope) and torch dtypes.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import transformers
from convert_fixtures import load_tool

from pretrain.checkpoint import dcp_reader, safe_load
from pretrain.convert.checkpoint_reader import read_checkpoint
from pretrain.convert.verify import our_model
from pretrain.errors import UserError

convert_from_megatron = load_tool("convert_from_megatron")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm"
NAMES = ["gpt2", "gpt2-no-optim", "llama", "llama-no-optim"]  # --ckpt-format torch
DIST = "llama-torch-dist"
ITERATION = 3


def _file(name: str) -> Path:
    return FIXTURES / name / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt"


def _megatron_args(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.args.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_the_file_holds_what_megatron_lm_main_pickles(name):
    """What makes these files hard: the globals Megatron-LM main's save_checkpoint pickled."""
    names = safe_load.pickled_globals(str(_file(name)))
    for expected in (
        "signal.Signals",
        "megatron.core.transformer.enums.AttnBackend",
        "megatron.core.transformer.enums.InferenceCudaGraphScope",
        "argparse.Namespace",
    ):
        assert expected in names
    checkpoint = safe_load.load(str(_file(name)), megatron=True)
    assert ("optimizer" in checkpoint) == ("no-optim" not in name)
    assert ("opt_param_scheduler" in checkpoint) == ("no-optim" not in name)
    args = checkpoint["args"]
    assert args.exit_signal is signal.SIGTERM  # the enum member, looked up by its number
    backend = args.attention_backend  # an inert record of Megatron's enum, not Megatron's class
    assert isinstance(backend, safe_load.ForeignValue)
    assert backend.qualified_name == "megatron.core.transformer.enums.AttnBackend"
    assert backend.args == (5,)  # AttnBackend.auto
    assert args.params_dtype is torch.float32


def test_torch_dist_common_state_holds_rerun_state_as_inert_records():
    """Main's torch_dist has no common.pt: args and the rerun state machine's state are read
    from the `common_state` object in the .distcp file, Megatron's enums as inert records."""
    from pretrain.convert import megatron_dist

    step = FIXTURES / DIST / f"iter_{ITERATION:07d}"
    assert not (step / "common.pt").exists()
    common = megatron_dist.read_common(str(step))
    assert common["iteration"] == ITERATION and common["checkpoint_version"] == 3.0
    assert common["args"].exit_signal is signal.SIGTERM
    assert common["args"].ckpt_format == "torch_dist"
    rerun = common["rerun_state_machine"]
    assert isinstance(rerun["mode"], safe_load.ForeignValue)
    assert rerun["mode"].qualified_name == "megatron.core.rerun_state_machine.RerunMode"
    assert rerun["mode"].args == ("validate_results",)
    assert rerun["state"].qualified_name == "megatron.core.rerun_state_machine.RerunState"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [*NAMES, DIST])
def test_converts_with_megatron_lm_logits(name, tmp_path, capsys):
    reference = torch.load(FIXTURES / f"{name}.reference.pt", weights_only=True)
    megatron = _megatron_args(name)
    tokens = megatron["vocab_size"] + 1  # NullTokenizer: ids 0..vocab_size-1, then eod
    convert_from_megatron.main(
        ["--load", str(FIXTURES / name), "--save", str(tmp_path / "ours")]
        + ["--output-dir", str(tmp_path / "hf")]
    )
    out = capsys.readouterr().out
    layout = "torch_dist" if name == DIST else "torch"
    assert f"({layout} format, TP=1, PP=1, iteration {ITERATION}" in out
    assert f"vocabulary {tokens}" in out  # the padding rows (to 256) are dropped

    ours = read_checkpoint(str(tmp_path / "ours"))
    config = ours.config
    groups = megatron["num_query_groups"] if megatron["group_query_attention"] else None
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (
        megatron["num_layers"],
        megatron["hidden_size"],
        megatron["num_attention_heads"],
    )
    assert config.ffn_size == megatron["ffn_hidden_size"]
    assert config.head_dim == megatron["kv_channels"]
    assert config.query_groups == (groups or megatron["num_attention_heads"])
    assert config.vocab_size == tokens
    assert config.padded_vocab_size() == megatron["padded_vocab_size"]
    assert config.max_positions == megatron["max_position_embeddings"]
    for ours_key, megatron_key in (
        ("seq_length", "seq_length"),
        ("position_embedding_type", "position_embedding_type"),
        ("rotary_base", "rotary_base"),
        ("normalization", "normalization"),
        ("norm_epsilon", "layernorm_epsilon"),
        ("swiglu", "swiglu"),
        ("openai_gelu", "openai_gelu"),
        ("add_bias_linear", "add_bias_linear"),
        ("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights"),
        ("hidden_dropout", "hidden_dropout"),
        ("attention_dropout", "attention_dropout"),
        ("init_method_std", "init_method_std"),
    ):
        assert getattr(config, ours_key) == megatron[megatron_key], ours_key

    expected = reference["logits"][..., :tokens]
    with torch.no_grad():
        logits = our_model(ours.state_dict, config)(reference["tokens"])
    torch.testing.assert_close(logits[..., :tokens], expected, rtol=0, atol=1e-5)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    with torch.no_grad():
        hf_logits = hf.float().eval()(reference["tokens"]).logits
    torch.testing.assert_close(hf_logits, expected, rtol=0, atol=1e-4)


@pytest.mark.timeout(300)
def test_conversion_imports_no_megatron(tmp_path):
    """Megatron's enums become inert records: a fresh process converts the Llama fixture to HF
    without importing any `megatron` module (megatron-core is installed here, as a test oracle)."""
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('tool', 'tools/convert_from_megatron.py')\n"
        "tool = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(tool)\n"
        "tool.main(['--load', sys.argv[1], '--output-dir', sys.argv[2]])\n"
        "print('imported:', sorted(n for n in sys.modules if n.split('.')[0] == 'megatron'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(FIXTURES / "llama"), str(tmp_path / "hf")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "imported: []" in done.stdout, done.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def _with_payload(source: Path, target: Path, marker: Path) -> None:
    """`source` (a torch.save zip) with one more top-level entry whose unpickling would call
    os.system: pickle opcodes appended to its data.pkl just before STOP (the dict is on top)."""
    command = f"touch {marker}".encode()
    payload = (
        b"X" + struct.pack("<I", 4) + b"evil"  # the key
        + b"c" + os.system.__module__.encode() + b"\nsystem\n"  # GLOBAL posix.system
        + b"X" + struct.pack("<I", len(command)) + command
        + b"\x85R"  # TUPLE1, REDUCE: system(command)
        + b"s"  # SETITEM into the checkpoint dict
    )  # fmt: skip
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            data = old.read(item)
            if item.filename.endswith("/data.pkl"):
                assert data.endswith(b".")
                data = data[:-1] + payload + b"."
            new.writestr(item, data)


def test_the_payload_runs_its_command_under_plain_unpickling(tmp_path):
    """The payload below is real: torch.load(weights_only=False) of a file carrying it runs it."""
    torch.save({"model": {}}, tmp_path / "plain.pt")
    _with_payload(tmp_path / "plain.pt", tmp_path / "doctored.pt", tmp_path / "pwned")
    loaded = torch.load(tmp_path / "doctored.pt", weights_only=False)
    assert loaded["evil"] == 0 and (tmp_path / "pwned").exists()


@pytest.mark.parametrize("name", NAMES)
def test_the_fixture_with_an_os_system_payload_is_refused(name, tmp_path):
    marker = tmp_path / "pwned"
    doctored = tmp_path / "model_optim_rng.pt"
    _with_payload(_file(name), doctored, marker)
    with pytest.raises(UserError, match=r"refused to load: it holds pickled global\(s\) posix\."):
        safe_load.load(str(doctored), megatron=True)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [False, True], ids=["relocated", "payload"])
def test_torch_dist_common_state_with_an_os_system_payload_is_refused(tmp_path, payload):
    """The torch_dist fixture whose `common_state` blob is appended again to the .distcp, with
    .metadata pointing at the copy: read as before (the control); with the payload added to that
    copy: refused, naming the .distcp file, and the command never runs."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from pretrain.convert import megatron_dist

    step = tmp_path / DIST / f"iter_{ITERATION:07d}"
    shutil.copytree(FIXTURES / DIST, tmp_path / DIST)
    metadata = dcp_reader.read_metadata(str(step))
    index, place = next(
        (i, p) for i, p in metadata.storage_data.items() if i.fqn.startswith("common_state")
    )
    shard = step / place.relative_path
    with open(shard, "rb") as f:
        f.seek(place.offset)
        (tmp_path / "common.pt").write_bytes(f.read(place.length))
    marker = tmp_path / "pwned"
    if payload:
        _with_payload(tmp_path / "common.pt", tmp_path / "doctored.pt", marker)
    blob = (tmp_path / ("doctored.pt" if payload else "common.pt")).read_bytes()
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = _StorageInfo(place.relative_path, offset, len(blob))
    metadata.storage_meta = None
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    if not payload:
        assert megatron_dist.read_common(str(step))["iteration"] == ITERATION
        return
    with pytest.raises(
        UserError, match=r"__0_0\.distcp \(common_state.*refused to load: .* posix\."
    ):
        convert_from_megatron.main(["--load", str(tmp_path / DIST), "--save", str(tmp_path / "o")])
    assert not marker.exists()
    assert not (tmp_path / "o").exists()


def test_torch_dist_weight_marked_a_byte_item_is_never_unpickled(tmp_path):
    """The torch_dist fixture whose `.metadata` marks a weight a byte item at an os.system
    payload appended to the .distcp: the converter never reads it (it reads tensor entries and
    `common_state` only) and stops with one line; the command never runs."""
    from dcp_fixtures import Payload, point_at_object

    shutil.copytree(FIXTURES / DIST, tmp_path / DIST)
    step = tmp_path / DIST / f"iter_{ITERATION:07d}"
    marker = tmp_path / "pwned"
    point_at_object(str(step), "embedding.word_embeddings.weight", Payload(marker), as_bytes=True)
    with pytest.raises(UserError) as refused:
        convert_from_megatron.main(["--load", str(tmp_path / DIST), "--save", str(tmp_path / "o")])
    assert "\n" not in str(refused.value)
    assert not marker.exists()
    assert not (tmp_path / "o").exists()
