"""Tensor-parallel layers, collectives, cross entropy, groups, grad norm and RNG on real gloo ranks.

One 4-rank world runs every check at TP=4 (dp=1) and TP=2 (dp=2); each layer is compared with
its torch.nn counterpart built from the same full weights: outputs, input grads, weight and bias
grads, relative error <= 1e-6 (fp32).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_on_ranks

from pretrain.errors import UserError
from pretrain.parallel import state
from pretrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from pretrain.parallel.grad_norm import global_grad_norm
from pretrain.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mask_padded_vocab_,
)
from pretrain.parallel.random import seed_everything, tensor_parallel_rng
from pretrain.parallel.sharding import mark_tensor_parallel, merge_shards, shard_tensor

TOL = 1e-6


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    err = ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL}"


def my_shard(full: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
    return shard_tensor(
        full,
        dim,
        state.get_tensor_model_parallel_rank(),
        state.get_tensor_model_parallel_world_size(),
        stride,
    )


def check_column(tp: int, gather_output: bool, stride: int) -> None:
    torch.manual_seed(10 + stride)  # same full tensors on every rank
    ref = torch.nn.Linear(12, 16)
    x = torch.randn(3, 5, 12, requires_grad=True)
    upstream = torch.randn(3, 5, 16)
    (ref(x) * upstream).sum().backward()

    layer = ColumnParallelLinear(12, 16, bias=True, gather_output=gather_output, stride=stride)
    assert layer.weight.shape == (16 // tp, 12) and layer.weight.partition_dim == 0
    with torch.no_grad():
        layer.weight.copy_(my_shard(ref.weight, 0, stride))
        layer.bias.copy_(my_shard(ref.bias, 0, stride))
    x_tp = x.detach().clone().requires_grad_(True)
    out = layer(x_tp)
    expected_out = ref(x).detach()
    if gather_output:
        assert_rel(out, expected_out, "column output (gathered)")
        (out * upstream).sum().backward()
    else:
        assert_rel(out, my_shard(expected_out, -1, stride), "column output shard")
        (out * my_shard(upstream, -1, stride)).sum().backward()
    what = f"column tp={tp} gather={gather_output} stride={stride}"
    assert_rel(x_tp.grad, x.grad, f"{what} input grad")
    assert_rel(layer.weight.grad, my_shard(ref.weight.grad, 0, stride), f"{what} weight grad")
    assert_rel(layer.bias.grad, my_shard(ref.bias.grad, 0, stride), f"{what} bias grad")


def check_row(tp: int, input_is_parallel: bool) -> None:
    torch.manual_seed(20)
    ref = torch.nn.Linear(16, 12)
    x = torch.randn(3, 5, 16, requires_grad=True)
    upstream = torch.randn(3, 5, 12)
    (ref(x) * upstream).sum().backward()

    layer = RowParallelLinear(16, 12, bias=True, input_is_parallel=input_is_parallel)
    assert layer.weight.shape == (12, 16 // tp) and layer.weight.partition_dim == 1
    assert not getattr(layer.bias, "tensor_model_parallel", False), "row bias is replicated"
    with torch.no_grad():
        layer.weight.copy_(my_shard(ref.weight, 1))
        layer.bias.copy_(ref.bias)
    x_in = (
        (x.detach() if not input_is_parallel else my_shard(x.detach(), -1))
        .clone()
        .requires_grad_(True)
    )
    out = layer(x_in)
    what = f"row tp={tp} input_is_parallel={input_is_parallel}"
    assert_rel(out, ref(x).detach(), f"{what} output")
    (out * upstream).sum().backward()
    assert_rel(
        x_in.grad, x.grad if not input_is_parallel else my_shard(x.grad, -1), f"{what} input grad"
    )
    assert_rel(layer.weight.grad, my_shard(ref.weight.grad, 1), f"{what} weight grad")
    assert_rel(layer.bias.grad, ref.bias.grad, f"{what} bias grad")


def check_embedding(tp: int) -> None:
    torch.manual_seed(30)
    ref = torch.nn.Embedding(32, 8)
    ids = torch.randint(0, 32, (4, 7))
    ids[0, :4] = torch.tensor([0, 31, 8, 24])  # shard boundaries
    upstream = torch.randn(4, 7, 8)
    (ref(ids) * upstream).sum().backward()

    layer = VocabParallelEmbedding(32, 8)
    with torch.no_grad():
        layer.weight.copy_(my_shard(ref.weight, 0))
    out = layer(ids)
    assert_rel(out, ref(ids).detach(), f"embedding tp={tp} output")
    (out * upstream).sum().backward()
    assert_rel(layer.weight.grad, my_shard(ref.weight.grad, 0), f"embedding tp={tp} weight grad")


def check_cross_entropy(tp: int) -> None:
    torch.manual_seed(40)
    logits = (3 * torch.randn(4, 6, 64)).requires_grad_(True)
    target = torch.randint(0, 64, (4, 6))
    target[0, :3] = torch.tensor([0, 63, 64 // tp])  # first/last id, first id of rank 1
    weights = torch.rand(4, 6)
    ref = F.cross_entropy(logits.view(-1, 64), target.view(-1), reduction="none").view(4, 6)
    (ref * weights).sum().backward()

    local = my_shard(logits.detach(), -1).clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target)
    assert loss.dtype == torch.float32
    assert_rel(loss, ref.detach(), f"cross entropy tp={tp} loss")
    (loss * weights).sum().backward()
    assert_rel(local.grad, my_shard(logits.grad, -1), f"cross entropy tp={tp} logits grad")


def check_cross_entropy_excludes_padding(tp: int) -> None:
    """Padded vocabulary ids (>= 37 of 64; at TP=4 rank 2 holds both kinds, rank 3 padding only)
    get -inf logits: the loss is torch's cross entropy over the 37 real ids alone, the real ids'
    gradient is torch's, and the padded ids' gradient is exactly zero."""
    vocab, padded = 37, 64
    torch.manual_seed(41)
    logits = (3 * torch.randn(4, 6, padded)).requires_grad_(True)
    target = torch.randint(0, vocab, (4, 6))
    target[0, :2] = torch.tensor([0, vocab - 1])
    weights = torch.rand(4, 6)
    real = logits[..., :vocab]
    ref = F.cross_entropy(real.reshape(-1, vocab), target.view(-1), reduction="none").view(4, 6)
    (ref * weights).sum().backward()

    local = my_shard(logits.detach(), -1).clone().requires_grad_(True)
    masked = mask_padded_vocab_(local * 1.0, vocab)  # in place on a non-leaf, as the LM head does
    loss = vocab_parallel_cross_entropy(masked, target)
    assert_rel(loss, ref.detach(), f"padded cross entropy tp={tp} loss")
    (loss * weights).sum().backward()
    expected_grad = torch.cat([logits.grad[..., :vocab], torch.zeros(4, 6, padded - vocab)], -1)
    assert_rel(local.grad, my_shard(expected_grad, -1), f"padded cross entropy tp={tp} grad")
    start = state.get_tensor_model_parallel_rank() * (padded // tp)
    is_padding = torch.arange(start, start + padded // tp) >= vocab
    assert torch.all(local.grad[..., is_padding] == 0)
    assert torch.all(torch.isneginf(masked[..., is_padding]))
    assert torch.isfinite(masked[..., ~is_padding]).all()


def check_embedding_init_ignores_padding(tp: int) -> None:
    """An embedding's real rows start the same at any padded size and TP; padding rows are zero."""
    full = {}
    for padded in (40, 64, 128):
        layer = VocabParallelEmbedding(padded, 8, vocab_size=37)
        layer.initialize("embedding.word_embeddings", 5, 0.02)
        shards = [torch.empty_like(layer.weight) for _ in range(tp)]
        dist.all_gather(
            shards, layer.weight.detach(), group=state.get_tensor_model_parallel_group()
        )
        full[padded] = torch.cat(shards)
        assert torch.equal(full[padded][37:], torch.zeros(padded - 37, 8))
    unpadded = VocabParallelEmbedding(37 * tp, 8, vocab_size=37)
    unpadded.initialize("embedding.word_embeddings", 5, 0.02)
    assert torch.equal(full[40][:37], full[64][:37]) and torch.equal(full[64][:37], full[128][:37])
    if state.get_tensor_model_parallel_rank() == 0:  # rank 0's 37 rows are all real here
        assert torch.equal(unpadded.weight.detach(), full[40][:37])
    assert abs(full[128][:37].std().item() / 0.02 - 1) < 0.2  # drawn, not zero


def check_groups(rank: int, world: int, tp: int, pp: int) -> None:
    dp = world // (tp * pp)
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    assert (
        state.get_tensor_model_parallel_rank(),
        state.get_data_parallel_rank(),
        state.get_pipeline_model_parallel_rank(),
    ) == (t, d, p)
    assert (
        state.get_tensor_model_parallel_world_size(),
        state.get_data_parallel_world_size(),
        state.get_pipeline_model_parallel_world_size(),
    ) == (tp, dp, pp)

    def members(group, size):
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(out, torch.tensor([rank]), group=group)
        return [int(x) for x in out]

    assert members(state.get_tensor_model_parallel_group(), tp) == [
        t2 + tp * (d + dp * p) for t2 in range(tp)
    ]
    assert members(state.get_data_parallel_group(), dp) == [
        t + tp * (d2 + dp * p) for d2 in range(dp)
    ]
    assert members(state.get_pipeline_model_parallel_group(), pp) == [
        t + tp * (d + dp * p2) for p2 in range(pp)
    ]
    assert state.get_data_parallel_group_ranks() == [t + tp * (d2 + dp * p) for d2 in range(dp)]
    embedding = sorted({t + tp * d, t + tp * (d + dp * (pp - 1))})
    in_embedding = p in (0, pp - 1)
    assert (state.get_embedding_group() is not None) == in_embedding
    if in_embedding:
        assert members(state.get_embedding_group(), len(embedding)) == embedding
    assert state.is_pipeline_first_stage() == (p == 0) and state.is_pipeline_last_stage() == (
        p == pp - 1
    )
    mpu = state.mpu
    assert mpu.get_model_parallel_world_size() == tp and mpu.get_model_parallel_rank() == t
    assert (
        mpu.get_data_parallel_world_size() == dp
        and mpu.get_tensor_model_parallel_src_rank() == tp * (d + dp * p)
    )


def check_tp_rng(tp: int) -> None:
    """Dropout RNG: same on TP peers outside TP regions, different per TP rank inside."""
    seed_everything(1234)
    outside = torch.rand(4)
    with tensor_parallel_rng():
        inside = torch.rand(4)
    after = torch.rand(4)  # the default stream continues as if the fork never happened
    seed_everything(1234)
    assert torch.equal(torch.rand(4), outside)
    assert torch.equal(torch.rand(4), after)
    group = state.get_tensor_model_parallel_group()
    for tensor, should_match in ((outside, True), (inside, False)):
        gathered = [torch.empty(4) for _ in range(tp)]
        dist.all_gather(gathered, tensor, group=group)
        matches = [torch.equal(g, gathered[0]) for g in gathered[1:]]
        assert all(matches) if should_match else not any(matches)


def check_grad_norm_over_tp_and_pp() -> None:
    """Each stage p holds a TP-sharded grad (full values G_p), a replicated grad R_p and a `shared`
    copy; the norm counts G_p and R_p exactly once per stage and skips the shared copy."""
    p, tp_rank = state.get_pipeline_model_parallel_rank(), state.get_tensor_model_parallel_rank()
    tp = state.get_tensor_model_parallel_world_size()
    full = torch.arange(8.0) + 10 * p
    sharded = torch.nn.Parameter(torch.zeros(8 // tp))
    mark_tensor_parallel(sharded, 0)
    sharded.grad = shard_tensor(full, 0, tp_rank, tp).clone()
    replicated = torch.nn.Parameter(torch.zeros(3))
    replicated.grad = torch.full((3,), float(p + 1))
    shared = torch.nn.Parameter(torch.zeros(2))
    shared.grad, shared.shared = torch.full((2,), 100.0), True
    no_grad = torch.nn.Parameter(torch.zeros(2))
    expected = sum(
        (torch.arange(8.0) + 10 * q).pow(2).sum() + 3 * (q + 1) ** 2
        for q in range(state.get_pipeline_model_parallel_world_size())
    ).sqrt()
    norm = global_grad_norm([sharded, replicated, shared, no_grad])
    torch.testing.assert_close(norm, expected.float(), rtol=1e-6, atol=0.0)


def layers_world(rank: int, world: int) -> list[str]:
    done = []
    with pytest.raises(
        UserError, match=r"world size 4 is not divisible by --tensor-model-parallel-size 3"
    ):
        state.initialize_model_parallel(3, 1)
    for tp, pp in ((4, 1), (2, 1), (2, 2), (1, 2)):
        state.initialize_model_parallel(tp, pp)
        check_groups(rank, world, tp, pp)
        check_grad_norm_over_tp_and_pp()
        if pp == 1:
            for gather_output in (False, True):
                for stride in (1, 2):
                    check_column(tp, gather_output, stride)
            for input_is_parallel in (True, False):
                check_row(tp, input_is_parallel)
            check_embedding(tp)
            check_cross_entropy(tp)
            check_cross_entropy_excludes_padding(tp)
            check_embedding_init_ignores_padding(tp)
            check_tp_rng(tp)
        state.destroy_model_parallel()
        done.append(f"tp{tp}pp{pp}")
    return done


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_layers_cross_entropy_groups_and_rng_on_4_ranks():
    results = run_on_ranks(layers_world, 4, timeout=240)
    assert results == [["tp4pp1", "tp2pp1", "tp2pp2", "tp1pp2"]] * 4


def test_shard_and_merge_round_trip():
    full = torch.arange(48.0).view(8, 6)
    for dim, stride in ((0, 1), (0, 2), (1, 1)):
        shards = [shard_tensor(full, dim, r, 2, stride) for r in range(2)]
        assert torch.equal(merge_shards(shards, dim, stride), full)
    gate_up = shard_tensor(full, 0, 1, 2, stride=2)  # rows [gate_1; up_1] = rows 2,3 then 6,7
    assert torch.equal(gate_up, full[[2, 3, 6, 7]])


def test_single_process_defaults_without_initialisation():
    assert (
        state.get_tensor_model_parallel_world_size() == 1
        and state.get_data_parallel_world_size() == 1
    )
    assert state.is_pipeline_first_stage() and state.is_pipeline_last_stage()
    torch.manual_seed(0)
    logits, target = torch.randn(3, 10), torch.randint(0, 10, (3,))
    assert torch.allclose(
        vocab_parallel_cross_entropy(logits, target),
        F.cross_entropy(logits, target, reduction="none"),
    )
    # padded ids 7..9 of a 7-token vocabulary: out of the loss and of the gradient at TP = 1 too
    leaf = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mask_padded_vocab_(leaf * 1.0, 7), target % 7)
    real = logits[:, :7].clone().requires_grad_(True)
    expected = F.cross_entropy(real, target % 7, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)
    loss.sum().backward(), expected.sum().backward()
    assert torch.equal(leaf.grad[:, 7:], torch.zeros(3, 3))
    torch.testing.assert_close(leaf.grad[:, :7], real.grad, rtol=1e-6, atol=1e-7)


def fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever: the helper must end it
    return rank


def hangs(rank: int, world: int) -> int:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        import time

        time.sleep(120)
    return rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_on_ranks_reports_the_failing_rank_and_enforces_the_timeout():
    import time

    start = time.monotonic()
    with pytest.raises(
        AssertionError, match=r"(?s)rank 1 of 2 failed in fails_on_rank_1.*boom on purpose"
    ):
        run_on_ranks(fails_on_rank_1, 2, timeout=60)
    with pytest.raises(TimeoutError, match=r"hangs on 2 ranks did not finish in 12 s"):
        run_on_ranks(hangs, 2, timeout=12)
    assert time.monotonic() - start < 60
