"""Cross entropy over logits whose vocabulary dimension is split across TP ranks.

No rank ever holds the full [.., V] logits. With each rank's shard [.., V/t]:
  1. the row max is all-reduced (MAX) and subtracted, for a stable exp;
  2. the target's logit is picked by the one rank owning that vocabulary id (others give 0) and
     all-reduced (SUM);
  3. the local sum of exp is all-reduced (SUM);
  loss = log(sum_exp) - target_logit.
Backward: softmax minus one-hot (only the owning rank subtracts 1), times the incoming gradient.
Computation is in fp32 whatever the logits' dtype. Labels must be valid ids in [0, V).
Logits of -inf (the padded vocabulary ids, see pretrain.parallel.layers.mask_padded_vocab_) are
left out exactly: exp(-inf) = 0 in the sum, and their gradient is 0. Some id of every row must be
finite, and no label may point at a -inf logit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain.parallel import state


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        group = state.get_tensor_model_parallel_group()
        local_vocab = logits.shape[-1]
        start = state.get_tensor_model_parallel_rank() * local_vocab
        ctx.logits_dtype = logits.dtype

        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)

        not_here = (target < start) | (target >= start + local_vocab)
        local_target = (target - start).masked_fill(not_here, 0)
        target_logit = (
            shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_here, 0.0)
        )
        dist.all_reduce(target_logit, group=group)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, not_here, local_target)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, not_here, local_target = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (not_here.float() - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss [...] (fp32) from TP-local logits [..., V/t] and full-vocabulary ids [...]."""
    if state.get_tensor_model_parallel_world_size() == 1:
        flat = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
        )
        return flat.view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target)
