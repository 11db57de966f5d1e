"""Offload flags and a --deepspeed_config JSON's offload sections -> the DeepSpeed config, and the
one-line refusals (ZeRO stage, NVMe folder, a flag that contradicts the JSON)."""

import json

import pytest
from test_arguments import ds_config
from training_fixtures import make_corpus, model_flags, train_flags

from pretrain.cli import parse_args
from pretrain.errors import UserError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("offload_args") / "corpus", num_docs=20)


def _parse(corpus, *extra):
    return parse_args(model_flags("gpt2") + train_flags(corpus) + list(extra), env={})


def _json(tmp_path, zero: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return str(path)


NVME = pytest.mark.needs_async_io  # NVMe offload needs DeepSpeed's async_io op (libaio)


@NVME
def test_flags_write_deepspeeds_sections(corpus, tmp_path):
    cpu = ds_config(_parse(corpus, "--zero-stage", "2", "--cpu-offload"))
    assert cpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert cpu["zero_force_ds_cpu_optimizer"] is False  # our AdamW steps the CPU state
    assert "offload_param" not in cpu["zero_optimization"]
    same = ds_config(_parse(corpus, "--zero-stage", "2", "--offload-optimizer", "cpu"))
    assert same == cpu
    infinity = ds_config(
        _parse(
            corpus,
            *("--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-param", "nvme"),
            *("--offload-nvme-path", str(tmp_path)),
        )
    )
    zero = infinity["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):
        assert zero[key] == {"device": "nvme", "pin_memory": False, "nvme_path": str(tmp_path)}
    plain = ds_config(_parse(corpus, "--zero-stage", "3"))
    assert "offload_optimizer" not in plain["zero_optimization"]
    assert "zero_force_ds_cpu_optimizer" not in plain


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--cpu-offload"], ["--cpu-offload needs ZeRO", "--zero-stage 1, 2 or 3"]),
        (["--zero-stage", "2", "--offload-param", "cpu"], ["--offload-param cpu needs --zero-stage 3"]),
        (["--zero-stage", "2", "--offload-optimizer", "nvme"], ["nvme needs --zero-stage 3", "--cpu-offload"]),
        (["--zero-stage", "3", "--offload-param", "nvme"], ["needs --offload-nvme-path DIR"]),
        (["--zero-stage", "3", "--offload-nvme-path", "/tmp"], ["--offload-nvme-path /tmp is only used with"]),
        (["--zero-stage", "1", "--cpu-offload", "--offload-optimizer", "nvme"], ["--cpu-offload and --offload-optimizer nvme disagree"]),
        (["--zero-stage", "3", "--offload-param", "nvme", "--offload-nvme-path", "/nonexistent/swap"], ["--offload-nvme-path /nonexistent/swap: no such folder"]),
        (["--zero-stage", "3", "--offload-param", "nvme", "--offload-nvme-path", "/proc/self"], ["--offload-nvme-path /proc/self: cannot write there"]),
        # DeepSpeed 0.19's checkpoints of NVMe-offloaded runs resume wrongly (docs/TRAINING.md)
        pytest.param(["--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-nvme-path", "/tmp", "--save", "/tmp/ck", "--save-interval", "2"], ["--save /tmp/ck with --offload-optimizer nvme", "do not resume correctly"], marks=NVME),
        pytest.param(["--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-nvme-path", "/tmp", "--load", "/tmp/ck"], ["--load /tmp/ck with --offload-optimizer nvme", "use --cpu-offload"], marks=NVME),
    ],
)  # fmt: skip
def test_refusals_are_one_line(corpus, extra, words):
    with pytest.raises(UserError) as err:
        _parse(corpus, *extra)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "\n" not in str(err.value)


@NVME
def test_json_offload_is_respected(corpus, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    path = _json(
        tmp_path,
        {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "nvme", "nvme_path": str(swap), "buffer_count": 7},
        },
    )
    cfg = _parse(corpus, "--deepspeed_config", path)
    assert (cfg.parallel.offload_optimizer, cfg.parallel.offload_param) == ("cpu", "nvme")
    assert cfg.parallel.offload_nvme_path == str(swap)
    zero = ds_config(cfg)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}  # the JSON's keys
    assert zero["offload_param"] == {
        **{"device": "nvme", "nvme_path": str(swap), "buffer_count": 7},
        "pin_memory": False,  # DeepSpeed's default, written out
    }
    assert ds_config(cfg)["zero_force_ds_cpu_optimizer"] is False  # else DeepSpeed refuses AdamW
    # a flag that says the same is fine
    again = _parse(corpus, "--deepspeed_config", path, "--cpu-offload", "--offload-param", "nvme")
    assert ds_config(again) == ds_config(cfg)


@pytest.mark.parametrize(
    "zero, extra, words",
    [
        ({"stage": 2, "offload_optimizer": {"device": "none"}}, ["--cpu-offload"], ["offload_optimizer.device=none but --cpu-offload is cpu"]),
        ({"stage": 3, "offload_param": {"device": "cpu"}}, ["--offload-param", "nvme", "--offload-nvme-path", "/tmp"], ["offload_param.device=cpu but --offload-param is nvme"]),
        ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, ["--offload-nvme-path", "/var/tmp"], ["nvme_path=/tmp but --offload-nvme-path is /var/tmp"]),
        ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nonexistent"}}, [], ["offload_param.nvme_path /nonexistent: no such folder"]),
        ({"stage": 3, "offload_param": {"device": "disk"}}, [], ["zero_optimization.offload_param", '"none" | "cpu" | "nvme"']),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, [], ["needs ZeRO"]),
        # Megatron-DeepSpeed's examples_deepspeed/offload_pp JSON: DeepSpeed asserts on it
        ({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3}}, [], ["offload_optimizer.ratio=0.3", "DeepSpeedCPUAdam", "remove the ratio key"]),
    ],
)  # fmt: skip
def test_json_contradicted_by_a_flag_is_refused(corpus, tmp_path, zero, extra, words):
    with pytest.raises(UserError) as err:
        _parse(corpus, "--deepspeed_config", _json(tmp_path, zero), *extra)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "\n" not in str(err.value)


def test_nvme_without_libaio_is_one_line(corpus, tmp_path, monkeypatch):
    """Where DeepSpeed's async_io op cannot build (no libaio), NVMe offload stops before launch."""
    from deepspeed.accelerator import get_accelerator

    builder = type(get_accelerator().create_op_builder("AsyncIOBuilder"))
    monkeypatch.setattr(builder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(UserError) as err:
        _parse(
            corpus,
            "--zero-stage",
            "3",
            "--offload-param",
            "nvme",
            "--offload-nvme-path",
            str(tmp_path),
        )
    assert "async_io" in str(err.value) and "apt-get install libaio-dev" in str(err.value)
    assert "\n" not in str(err.value)
    cpu = _parse(corpus, "--zero-stage", "3", "--offload-param", "cpu")  # cpu needs no async_io
    assert cpu.parallel.offload_param == "cpu"
