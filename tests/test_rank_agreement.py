"""The line every rank prints when the ranks do not run the same job, for each thing compared
(tests/test_slurm_launchers.py runs the command-line case on the real two-node cluster): what
the gathered identities of four ranks on two nodes give, written out by hand."""

from __future__ import annotations

import json

from pretrain.training.rank_agreement import _command_line, _disagreement

FIX = (
    "; every node must run the same code and command line on the same data (check what differs "
    "on {nodes}: its environment, checkout, Python environment or files)"
)


def _ranks(**changes: dict) -> list[dict]:
    """Four identical identities (ranks 0-1 on n1, 2-3 on n2), then `changes` per rank ("r2")."""
    same = {
        "software": "python 3.11.7, torch 2.13.0+cpu, deepspeed 0.19.8, numpy 2.2.6",
        "code": "925c32dd1571",
        "command line": ["--data-path", "/data/c", "--seed", "7"],
        "data": json.dumps({"/data/c": {"documents": 200, "tokens": 6379}}),
    }
    ranks = [{"rank": r, "node": "n1" if r < 2 else "n2", **same} for r in range(4)]
    for name, change in changes.items():
        ranks[int(name[1:])].update(change)
    return ranks


def test_the_same_job_everywhere_is_no_disagreement():
    assert _disagreement(_ranks()) is None


def test_other_software_on_a_node_is_named_first():
    other = {"software": "python 3.11.7, torch 2.12.0+cpu, deepspeed 0.19.8, numpy 2.2.6"}
    ranks = _ranks(r2=other, r3=other, r1={"code": "000000000000"})
    assert _disagreement(ranks) == (
        "the ranks do not run the same job: their software differs: rank 0 (n1) has python "
        "3.11.7, torch 2.13.0+cpu, deepspeed 0.19.8, numpy 2.2.6, ranks 2-3 (n2) have python "
        "3.11.7, torch 2.12.0+cpu, deepspeed 0.19.8, numpy 2.2.6" + FIX.format(nodes="n2")
    )


def test_other_code_on_one_rank_and_a_third_version_elsewhere():
    ranks = _ranks(r3={"code": "111111111111"}, r2={"code": "222222222222"})
    assert _disagreement(ranks) == (
        "the ranks do not run the same job: their code differs: rank 0 (n1) has 925c32dd1571, "
        "rank 2 (n2) has 222222222222 (1 more rank(s) have yet another)" + FIX.format(nodes="n2")
    )


def test_a_command_line_names_the_flag_whose_value_differs():
    ranks = _ranks(r1={"command line": ["--data-path", "/data/c", "--seed", "8"]})
    assert _disagreement(ranks) == (
        "the ranks do not run the same job: their command line differs: rank 0 (n1) has "
        "--seed 7, rank 1 (n1) has --seed 8" + FIX.format(nodes="n1")
    )


def test_other_data_at_the_same_path_names_the_prefix_and_its_counts():
    stale = json.dumps({"/data/c": {"documents": 150, "tokens": 5000}})
    ranks = _ranks(r2={"data": stale}, r3={"data": stale})
    assert _disagreement(ranks) == (
        "the ranks do not run the same job: their data differs: rank 0 (n1) has /data/c: "
        "{'documents': 200, 'tokens': 6379}, ranks 2-3 (n2) have /data/c: {'documents': 150, "
        "'tokens': 5000}" + FIX.format(nodes="n2")
    )


def test_the_deepspeed_launchers_local_rank_is_not_part_of_the_command_line():
    assert _command_line(("--local_rank=1", "--seed", "7")) == ["--seed", "7"]
    assert _command_line(("--seed", "7", "--local-rank", "3", "--x")) == ["--seed", "7", "--x"]
