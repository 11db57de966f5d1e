"""Training backends behind `pretrain.training.engine.Engine`; each package imports its own
library and nothing outside it does."""
