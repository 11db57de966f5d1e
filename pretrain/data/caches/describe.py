"""Megatron's cache descriptions, `json.dumps(identifiers, indent=4)`, made fast for big blends.

The md5 of a dataset's description names its cache files, so the text must be Megatron's to the
byte. `json.dumps` with an indent runs the pure-Python encoder; a blend of thousands of prefixes
describes thousands of GPTDatasets that differ only in their path and sample count, and then one
BlendedDataset that nests all of them. Here the indented text of everything else is made once
(a template per set of common identifiers) and the varying values, each a JSON scalar whose text
does not depend on its indentation, are put in; a blend nests its datasets' texts indented one
level deeper, which is what the indenting encoder writes for a list of objects.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Sequence

_HOLE = "\x00{}\x00"  # a placeholder string no identifier holds
VARYING = ("dataset_path", "num_samples")


def _hole(name: str) -> str:
    """The JSON text of the placeholder for `name`."""
    return json.dumps(_HOLE.format(name))


@functools.lru_cache(maxsize=64)
def _template(compact: str) -> str:
    """The indented text of the identifiers whose compact JSON is `compact`."""
    return json.dumps(json.loads(compact, object_pairs_hook=OrderedDict), indent=4)


def describe(identifiers: OrderedDict) -> str:
    """`json.dumps(identifiers, indent=4)` of a dataset's identifiers (dataset_path and
    num_samples being scalars)."""
    holes = OrderedDict(identifiers)
    for name in VARYING:
        holes[name] = _HOLE.format(name)
    text = _template(json.dumps(holes))
    for name in VARYING:
        text = text.replace(_hole(name), json.dumps(identifiers[name]), 1)
    return text


def describe_blend(identifiers: OrderedDict, descriptions: Sequence[str]) -> str:
    """`json.dumps(identifiers, indent=4)` of a BlendedDataset whose "datasets" entry is the list
    of objects described by `descriptions` (each `describe`'s text)."""
    holes = OrderedDict(identifiers)
    holes["datasets"] = [_HOLE.format("datasets")]
    text = json.dumps(holes, indent=4)
    nested = ",\n".join(
        "\n".join("        " + line for line in text_.split("\n")) for text_ in descriptions
    )
    return text.replace("        " + _hole("datasets"), nested, 1)
