"""Blends that cannot feed training are refused before launch (`check_splits_before_launch`, in
pretrain_gpt.py's start-up, tools/build_data_cache.py and tools/plan_blend.py): a blend part that
gives the train split no data is one error line naming it, a part without validation data and a
prefix listed twice are one warning each; megatron-core, on the same blend, never returns or fails
an assertion (the oracle). The empty-split tests of a whole split are in test_data_reliability.py,
whose helpers these tests share."""

import os
import re
import subprocess

import pytest
from test_data_gpt_dataset import write_corpus
from test_data_reliability import (
    CACHE_FLAGS,
    ENV,
    NULL_TOKENIZER,
    PY,
    ROOT,
    _empty_dataset,
    one_error_line,
    tool,
)

from pretrain.data.config import DataConfig
from pretrain.errors import UserError


def _blend_part(tmp_path, kind):
    """(a 200-document prefix, the part that gives a train split nothing, --split, its why)."""
    big = write_corpus(str(tmp_path / "big"), [20] * 200)
    if kind == "allow-empty":  # what preprocess_data.py --allow-empty writes for an empty corpus
        return big, _empty_dataset(str(tmp_path / "part"), 0), "90,10,0", "holds 0 documents"
    one = write_corpus(str(tmp_path / "part"), [20])  # round(0.01 * 1) = 0 train documents
    return big, one, "1,99,0", "--split 1,99,0 gives it 0 of the 1 sequences"


def _blend_args(tmp_path, blend, split, eval_iters="0"):
    args = ["--data-path", *blend, "--split", split, "--train-iters", "5"]
    return [*args, "--eval-iters", eval_iters, *CACHE_FLAGS, *NULL_TOKENIZER]


def _parse_training_args(blend, split, eval_iters="0"):
    from training_fixtures import model_flags, train_flags

    from pretrain.cli import parse_args

    argv = model_flags("gpt2") + train_flags(blend[-1]) + ["--vocab-size", "1001"]
    argv += ["--data-path", *blend, "--split", split, "--eval-iters", eval_iters]
    return parse_args(argv + ["--eval-interval", "2"], env={})


@pytest.mark.parametrize("kind", ["allow-empty", "one-document"])
@pytest.mark.parametrize("script", ["build_data_cache.py", "plan_blend.py", "pretrain_gpt.py"])
def test_blend_part_without_train_data_is_refused_before_launch(tmp_path, kind, script):
    # before: the part was dropped, the other drawn at weight 1.0, and training hit StopIteration
    big, part, split, why = _blend_part(tmp_path, kind)
    blend = ["0.5", big, "0.5", part]
    if script == "pretrain_gpt.py":  # its start-up, before any process group: parse_args
        with pytest.raises(UserError) as refused:
            _parse_training_args(blend, split)
        line = str(refused.value)
        assert "\n" not in line
    else:
        line = one_error_line(tool(script, _blend_args(tmp_path, blend, split)))
    assert f"the train split of blend part {part} is empty" in line and why in line, line
    assert big not in line.replace(part, "")  # names the part, not the healthy prefix
    built = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".npy")]
    assert built == []  # refused before any index was built


def test_blend_part_without_train_data_is_refused_unweighted(tmp_path):
    big, part, split, why = _blend_part(tmp_path, "one-document")
    line = one_error_line(tool("build_data_cache.py", _blend_args(tmp_path, [big, part], split)))
    assert f"the train split of blend part {part} is empty" in line and why in line


def test_per_split_train_blend_part_without_data_is_refused(tmp_path):
    from pretrain.data.builder import check_splits_before_launch

    big, part, _, why = _blend_part(tmp_path, "allow-empty")
    cfg = DataConfig(seq_length=16, blend_per_split=[([big, part], [1.0, 1.0]), None, None])
    with pytest.raises(UserError, match=f"blend part {re.escape(part)} is empty") as refused:
        check_splits_before_launch(cfg, [20, 0, 0])
    assert why in str(refused.value) and f"drop {part} from --train-data-path" in str(refused.value)


@pytest.mark.parametrize("script", ["build_data_cache.py", "plan_blend.py"])
def test_blend_part_without_validation_data_is_a_warning(tmp_path, script):
    big = write_corpus(str(tmp_path / "big"), [20] * 200)
    one = write_corpus(str(tmp_path / "one"), [20])  # --split 99,1,0: 1 train, 0 valid documents
    proc = tool(script, _blend_args(tmp_path, ["0.5", big, "0.5", one], "99,1,0", "2"))
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(said) == 1, proc.stderr
    assert f"the valid split of blend part {one} is empty" in said[0]
    assert "drawn from the other parts of --data-path only" in said[0]


@pytest.mark.parametrize("script", ["build_data_cache.py", "plan_blend.py", "pretrain_gpt.py"])
def test_prefix_listed_twice_is_one_warning(tmp_path, script, capsys):
    a = write_corpus(str(tmp_path / "a"), [20] * 50)
    b = write_corpus(str(tmp_path / "b"), [20] * 50, seed=1)
    again = os.path.join(str(tmp_path), ".", "a")  # the same files, spelled differently
    blend = ["0.3", a, "0.5", b, "0.2", again]
    if script == "pretrain_gpt.py":
        _parse_training_args(blend, "90,10,0")
        stderr = capsys.readouterr().err
    else:
        proc = tool(script, _blend_args(tmp_path, blend, "90,10,0"))
        assert proc.returncode == 0, proc.stderr
        stderr = proc.stderr
    said = [line for line in stderr.splitlines() if "lists" in line]
    assert len(said) == 1, stderr
    assert said[0].startswith(f"warning: --data-path lists {a} 2 times (as {a}, {again}; ")
    assert "weights 0.3, 0.2: together 50.0% of the blend" in said[0]
    assert "over the same documents: their samples are read up to 2 times" in said[0]


MEGATRON_ON_A_PART_WITHOUT_TRAIN_DATA = """
import faulthandler, sys, warnings
warnings.filterwarnings("ignore")
import torch
from test_data_gpt_dataset import TOKENIZER, megatron_core_datasets, megatron_gpt
megatron_gpt()  # import megatron-core before the clock starts
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store",
                                     rank=0, world_size=1)
big, part = sys.argv[2:4]
def build(weights, cache):
    return megatron_core_datasets([20, 0, 0], TOKENIZER, sys.argv[1] + cache, random_seed=1,
                                  sequence_length=16, blend=([big, part], weights), split="1,99,0")
try:
    build(None, "/unweighted")
except AssertionError:
    print("unweighted: AssertionError", flush=True)
faulthandler.dump_traceback_later(float(sys.argv[4]), exit=True)  # all threads, then exit 1
build([0.5, 0.5], "/weighted")
print("weighted: built", flush=True)
"""


@pytest.mark.slow  # over 10 s of end-to-end tool runs: not in `make test-fast`
@pytest.mark.timeout(240)
def test_megatron_core_cannot_train_on_a_blend_part_without_train_data(tmp_path):
    """The oracle for the refusal: megatron-core's BlendedMegatronDatasetBuilder over the same
    one-document part: unweighted it fails an assertion (a blend weight of 0), weighted it never
    returns (its GPTDataset counts epochs of 0 tokens until the requested tokens are reached)."""
    big, part, _, _ = _blend_part(tmp_path, "one-document")
    proc = subprocess.run(
        [PY, "-c", MEGATRON_ON_A_PART_WITHOUT_TRAIN_DATA, str(tmp_path), big, part, "20"],
        cwd=os.path.join(ROOT, "tests"),
        env=dict(ENV, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert "unweighted: AssertionError" in proc.stdout, proc.stderr[-3000:]
    assert "weighted: built" not in proc.stdout
    assert proc.returncode == 1 and "Timeout" in proc.stderr, proc.stderr[-3000:]
    assert "in _get_num_epochs" in proc.stderr, proc.stderr[-3000:]
