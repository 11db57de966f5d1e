"""Megatron-LM command-line flags -> the configs of one training run (`RunConfig`).

One concept per module:

- `flags`: `FLAGS`, the one table of training flags (spellings, argparse options, the config
  field each fills), the flags Megatron removed, and `build_parser()` made from the table;
- `resolve`: the values several flags make together (batch arithmetic, the LR schedule in
  samples, GQA, RoPE and recompute spellings, precision with the DeepSpeed JSON) and the checks
  argparse cannot make;
- `parse`: `parse_args(argv)`, the only place that sees a whole command line: parse, resolve,
  check, in a fixed order, then build the tokenizer and look at the data once for the run;
- `data_tools`: the data tools' parsers, which share training's data flags.

Flag spellings are Megatron-LM's. Megatron-DeepSpeed's spellings are accepted as aliases
(`--num-key-value-heads`, `--normalization rmsnorm`, `--use-rotary-position-embeddings`,
`--zero-stage`, `--no-pipeline-parallel`), as are DeepSpeed's own (`--deepspeed`,
`--deepspeed_config`, `--local_rank`). Flags Megatron removed are refused with their new name.
Every failed check raises `UserError` with one line naming the flag(s), the values and the fix,
before any process group exists.
"""

from pretrain.cli.data_tools import data_tool_parser, parse_data_tool_args
from pretrain.cli.flags import DEPRECATED_FLAGS, FLAGS, Flag, build_parser
from pretrain.cli.parse import parse_args

__all__ = [
    "DEPRECATED_FLAGS",
    "FLAGS",
    "Flag",
    "build_parser",
    "data_tool_parser",
    "parse_args",
    "parse_data_tool_args",
]
