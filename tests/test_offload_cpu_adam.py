"""Offload keeps our optimizer (torch AdamW over Megatron's groups); DeepSpeed's own offload
optimizer, DeepSpeedCPUAdam, would compute the same update only in its adamw_mode=True.

This pins the fact docs/TRAINING.md ("Offload") states: DeepSpeedCPUAdam(adamw_mode=True) is
decoupled weight decay, equal to torch AdamW within fp32 rounding, per parameter group, under a
changing learning rate; adamw_mode=False adds the decay to the gradient (L2, Adam's original), a
different optimizer. The op is JIT-compiled C++ (minutes of CPU): tests/op_builds.py builds it in
the background from the start of the session; if the build is still running, the test waits on
torch's build lock.
"""

import pytest
import torch

from pretrain.training.schedules.optimizer import param_groups


def _train(make_optimizer) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64))
    opt = make_optimizer(param_groups(model.named_parameters(), 0.1))
    grads = torch.Generator().manual_seed(1)
    for step in range(5):
        for group in opt.param_groups:  # as our LR scheduler does
            group["lr"] = 3e-3 * (step + 1) / 5
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=grads)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow  # DeepSpeed builds its cpu_adam op first: minutes of CPU on a fresh clone
@pytest.mark.timeout(1800)  # the JIT build, where the background one has not finished
def test_deepspeed_cpu_adam_in_adamw_mode_is_our_adamw():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ours = _train(lambda groups: torch.optim.AdamW(groups, **hyper))
    decoupled = _train(lambda groups: DeepSpeedCPUAdam(groups, adamw_mode=True, **hyper))
    l2 = _train(lambda groups: DeepSpeedCPUAdam(groups, adamw_mode=False, **hyper))
    for a, b in zip(decoupled, ours, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the matrices (weight decay 0.1) move differently with L2 decay; the rest does not decay
    assert (l2[0] - ours[0]).abs().max() > 1e-4
    torch.testing.assert_close(l2[1], ours[1], rtol=1e-6, atol=1e-6)
