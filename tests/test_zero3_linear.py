"""ZeRO-3's LinearFunctionForZeroStage3 against F.linear in the autograd model, worked by hand on toy sizes
(blocks_linear.linear with keeps_input): where the input's grad accumulates, and what a checkpoint's recompute
that stops at the layer allocates.

Two linears read one input x [T, IN] (as q/k/v or gate/up read a norm's output). F.linear hands x a view of its
grad (the reshape it folds), so InputBuffer sums the second grad out of place: one more [T, IN] tensor.
LinearFunctionForZeroStage3's backward folds the matmul inside itself (at::matmul's _unsafe_view, no view): the
sum is in place. In a checkpointed layer whose last saving op is that custom Function, the recompute stops in its
setup_context, after its forward made the output [T, OUT]: the output is allocated and freed at once, where an
aten op packs its inputs before its kernel runs and makes nothing.
"""

from memplan.estimator.autograd import Autograd
from memplan.estimator.blocks_linear import linear
from memplan.estimator.checkpoint import nonreentrant
from memplan.ledger import Ledger

T, IN, OUT, B = 8, 4, 6, 2


def _two_readers(keeps_input: bool) -> Ledger:
    L = Ledger()
    ag = Autograd(L, on_param_grad=lambda p, g: ag.release(g))
    w0 = ag.param("w0", 64)
    x = ag.op("x", T * IN * B, (w0,))
    wa, wb = ag.param("a.weight", OUT * IN * B), ag.param("b.weight", OUT * IN * B)
    ya = linear(ag, x, wa, T * OUT * B, "a", transposed=not keeps_input, keeps_input=keeps_input)
    yb = linear(ag, x, wb, T * OUT * B, "b", transposed=not keeps_input, keeps_input=keeps_input)
    ag.release(x)
    y = ag.op("sum", T * OUT * B, (ya, yb))
    ag.release(ya)
    ag.release(yb)
    ag.backward(y, T * OUT * B)
    ag.release(y)
    return L


def test_f_linear_sums_the_input_grads_out_of_place():
    L = _two_readers(keeps_input=False)
    assert sum(1 for ev in L.events if ev >= 0 and L.names[ev] == "grad.accumulate") == 1


def test_zero3_linear_sums_the_input_grads_in_place():
    L = _two_readers(keeps_input=True)
    assert not any(ev >= 0 and L.names[ev] == "grad.accumulate" for ev in L.events)


def _checkpointed(keeps_input: bool) -> tuple[Ledger, int]:
    L = Ledger()
    ag = Autograd(L, on_param_grad=lambda p, g: ag.release(g))
    w0 = ag.param("w0", 64)
    x = ag.op("x", T * IN * B, (w0,))
    w = ag.param("fc.weight", OUT * IN * B)
    layer = nonreentrant(ag)
    y = layer(0, x, lambda z: linear(ag, z, w, T * OUT * B, "fc", transposed=not keeps_input,
                                     keeps_input=keeps_input))
    ag.release(x)
    mark = len(L.events)
    ag.backward(y, T * OUT * B)
    ag.release(y)
    return L, mark


def test_a_recompute_stopping_at_the_custom_function_makes_and_drops_its_output():
    L, mark = _checkpointed(keeps_input=True)
    made = [k for k in range(mark, len(L.events)) if L.events[k] >= 0 and L.names[L.events[k]] == "fc"]
    assert len(made) == 1
    k = made[0]
    assert L.events[k + 1] == ~L.events[k] and L.sizes[L.events[k]] == T * OUT * B  # freed at once


def test_a_recompute_stopping_at_an_aten_op_makes_nothing():
    L, mark = _checkpointed(keeps_input=False)
    assert not any(L.events[k] >= 0 and L.names[L.events[k]] == "fc" for k in range(mark, len(L.events)))
