"""Each model family's forward in the autograd model (``forward(net) -> Output``), by ModelSpec.family."""

from __future__ import annotations

from ..transformer import Net, Output
from . import llama

#: family → its forward
FORWARD = {"llama": llama.forward}


def forward(net: Net) -> Output:
    """The model's forward for its family (KeyError names a family not written yet)."""
    return FORWARD[net.m.family](net)
