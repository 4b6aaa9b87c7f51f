"""Parameter and module names: one rule for the whole project.

A parameter ``model.layers.3.mlp.down_proj.weight`` belongs to the module
``model.layers.3.mlp.down_proj`` (its dotted prefix); the module's layer index is 3 and its kind
``mlp.down_proj`` (the name after the index).
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"^(?P<prefix>.*?)\.?(?P<layer>\d+)\.(?P<kind>.+)$")


def module_of(param_name: str) -> str:
    """The module holding a parameter: its dotted prefix ("" for a top-level parameter)."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def layer_and_kind(module: str) -> tuple[int | None, str]:
    """``model.layers.3.self_attn.q_proj`` -> (3, "self_attn.q_proj"); no layer index: (None, module)."""
    m = _LAYER.match(module)
    return (int(m["layer"]), m["kind"]) if m else (None, module)
