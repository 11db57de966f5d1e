"""How the step size and the batch change: the LR schedule, the batch-size schedule
(--rampup-batch-size, --step-batch-size-schedule) and the optimizer.

May import: nothing of `training/` (only the layers below it)."""
