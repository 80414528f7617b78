"""Toy cases of estimator/checkpoint.py's non-reentrant recompute, worked by hand."""

from __future__ import annotations

from memplan.estimator.autograd import Autograd
from memplan.estimator.checkpoint import nonreentrant
from memplan.ledger import Ledger


def _checkpointed_linear_then_hook(L: Ledger, ag: Autograd, fired: list[int]):
    """x → checkpoint(mm(mul(x), w) wrapped in a hook that saves nothing) → sum: the shape of a decoder layer's
    last module under ZeRO-3 (its output wrapped in PreBackwardFunctionForModule). The recompute stops once mm
    has packed what it saves: of the rerun only mul's output is allocated."""
    w = ag.param("w", 64)
    x = ag.empty("x", 32, requires_grad=True)

    def run(z):
        a = ag.op("mul", 32, (z,), saved=(z,))
        y = ag.op("mm", 16, (a, w), saved=(a, w))
        ag.release(a)
        hooked = ag.marker(y, lambda: fired.append(len(L.events)))
        ag.release(y)
        return hooked

    out = nonreentrant(ag)(0, x, run)
    loss = ag.op("sum", 4, (out,))
    ag.release(out)
    ag.release(x)
    return loss


def test_recompute_waits_for_the_first_unpack():
    """torch/utils/checkpoint.py reruns the region in unpack_hook, when a node first unpacks a saved tensor: the
    hook's node (which saved nothing) runs its backward before the rerun allocates anything."""
    L = Ledger()
    ag = Autograd(L)
    fired: list[int] = []
    loss = _checkpointed_linear_then_hook(L, ag, fired)
    ag.backward(loss, 4)
    mul = [i for i, ev in enumerate(L.events) if ev >= 0 and L.names[ev] == "mul"]
    assert len(mul) == 2  # the forward's output and the recompute's
    assert len(fired) == 1
    assert mul[0] < fired[0] <= mul[1]


def test_recompute_happens_once_and_frees_what_it_made():
    """The region reruns once; after backward nothing it made is left (the frame's input died with it)."""
    L = Ledger()
    ag = Autograd(L)
    loss = _checkpointed_linear_then_hook(L, ag, [])
    ag.backward(loss, 4)
    ag.release(loss)
    assert sum(1 for ev in L.events if ev >= 0 and L.names[ev] == "mul") == 2
    assert not L.live()


def test_a_region_that_saves_nothing_never_recomputes():
    """No saved tensor, no unpack: the rerun never happens and the frame keeps nothing past the forward."""
    L = Ledger()
    ag = Autograd(L)
    x = ag.empty("x", 32, requires_grad=True)
    out = nonreentrant(ag)(0, x, lambda z: ag.op("add", 32, (z,)))
    ag.release(x)
    assert [L.names[t] for t in L.live()] == ["add"]  # the frame let go of x
    loss = ag.op("sum", 4, (out,))
    ag.release(out)
    ag.backward(loss, 4)
    ag.release(loss)
    assert sum(1 for ev in L.events if ev >= 0 and L.names[ev] == "add") == 1
    assert not L.live()
