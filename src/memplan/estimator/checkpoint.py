"""Activation checkpointing of decoder layers as transformers 5.17 applies it (GradientCheckpointingLayer.__call__
→ ``torch.utils.checkpoint.checkpoint(layer, hidden_states, …, use_reentrant=…)``).

Non-reentrant (transformers' default, ``use_reentrant=False``; torch/utils/checkpoint.py
_checkpoint_without_reentrant_generator): the forward runs with grad enabled, so autograd's nodes exist, but
saved-tensor hooks keep handles instead of tensors; the checkpoint frame keeps the layer's inputs. When backward
first unpacks a saved tensor of the region, the frame reruns the layer's forward and hands each node the tensor
it saved; the rerun's own graph is dropped. Reentrant (``use_reentrant=True``; CheckpointFunction): the forward
runs under no_grad and one node saves the inputs; its backward reruns the forward with grad enabled and runs a
nested backward through it. Memory-wise both keep each layer's input through forward and, in backward, one
layer's activations at a time.
"""

from __future__ import annotations

from .autograd import Autograd, Tensor


class Region:
    """One checkpointed layer call: its nodes, the inputs the frame keeps, and how to rerun it."""

    def __init__(self, ag: Autograd, x: Tensor, run, extras: tuple[Tensor, ...]):
        self.ag, self.x, self.run = ag, x, run
        self.extras = tuple(ag.ref(t) for t in extras)
        self.nodes: list = []
        self.last_saving = -1  # position in ``nodes`` of the last node that saves a tensor
        self.done = False

    def recompute(self) -> None:
        """Rerun the layer's forward with saving on and give each recorded node what its twin saved."""
        ag = self.ag
        self.done = True
        start = len(ag.nodes)
        outer, ag.region = ag.region, None
        # torch.utils.checkpoint's early stop: the rerun ends once the region's last saved tensor is packed
        ag.stop_at = start + self.last_saving
        ag.recomputing = True
        ag.recompute_detached.clear()
        out = self.run(self.x)
        ag.region, ag.stop_at, ag.suppress, ag.recomputing = outer, None, False, False
        twins = ag.nodes[start:]
        originals = [n for n in self.nodes]
        for orig, twin in zip(originals, twins):
            orig.saved, twin.saved = twin.saved, ()
            orig.unpacked = True
        del ag.nodes[start:]
        for t in out if isinstance(out, tuple) else (out,):  # the rerun's outputs are dropped
            ag.release(t)
        self.holders = sum(1 for n in originals if n.saved)
        if not self.holders:
            self.release_frame()

    def release_frame(self) -> None:
        """The checkpoint frame dies with the last saved tensor it handed out: its inputs go with it (the
        keyword arguments first, as seen in CPU traces, then the hidden states)."""
        for t in self.extras:
            self.ag.release(t)
        self.ag.release(self.x)

    def released(self) -> None:
        """One of the region's nodes released what it saved."""
        self.holders -= 1
        if self.holders == 0:
            self.release_frame()


def nonreentrant(ag: Autograd):
    """A Net.layer_fn checkpointing every layer the non-reentrant way."""
    def layer_fn(i: int, x: Tensor, run, extras: tuple[Tensor, ...] = ()) -> Tensor:
        region = Region(ag, ag.ref(x), run, extras)
        start = len(ag.nodes)
        saving, ag.saving = ag.saving, False
        outer, ag.region = ag.region, region
        out = run(x)
        ag.saving, ag.region = saving, outer
        region.nodes = ag.nodes[start:]
        region.last_saving = max((k for k, n in enumerate(region.nodes) if n.would_save), default=-1)
        if region.last_saving < 0:  # nothing packed, nothing to unpack: no handle keeps the frame
            region.done = True
            region.release_frame()
        return out
    return layer_fn
