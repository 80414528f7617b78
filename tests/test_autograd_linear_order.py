"""blocks_linear.linear's backward, worked by hand on one layer: which parameter's AccumulateGrad (and so which reduce
hook) runs first, and when the engine thread's cuBLAS workspace is made.

engine.cpp evaluate_function walks a node's next_edges in order and AccumulateGrad's maximum sequence number
pops each as soon as it is ready: AddmmBackward0's edges are (self = bias, mat1 = input, mat2 = weight), so
nn.Linear's bias reaches its hook before its weight; ZeRO-3's LinearFunctionForZeroStage3.apply(input, weight,
bias) orders them input, weight, bias.
"""

from memplan.estimator.autograd import Autograd
from memplan.estimator.blocks_linear import linear
from memplan.ledger import Ledger

T, IN, OUT, B = 8, 4, 6, 2  # tokens, features in and out, bytes per element


def _run(keeps_input: bool):
    L = Ledger()
    order = []
    ag = Autograd(L, on_param_grad=lambda p, g: (order.append(p.param), ag.release(g)))
    workspaces = []
    ag.backward_matmul = lambda: workspaces.append(len(L.events))
    x = ag.empty("x", T * IN * B, requires_grad=True)
    w = ag.param("fc.weight", OUT * IN * B)
    b = ag.param("fc.bias", OUT * B)
    y = linear(ag, x, w, T * OUT * B, "fc", bias=b, keeps_input=keeps_input)
    ag.release(x)
    ag.backward(y, T * OUT * B)
    return L, order, workspaces


def test_addmm_hands_the_bias_its_grad_before_the_weight():
    L, order, _ = _run(keeps_input=False)
    assert order == ["fc.bias", "fc.weight"]


def test_zero3_linear_hands_the_weight_its_grad_before_the_bias():
    L, order, _ = _run(keeps_input=True)
    assert order == ["fc.weight", "fc.bias"]


def test_the_first_backward_gemm_makes_the_workspace_after_its_output():
    """AddmmBackward0 computes the input's grad [T, IN] first: the workspace hook runs right after that
    allocation, once."""
    L, _, workspaces = _run(keeps_input=False)
    assert len(workspaces) == 1
    first = L.events[workspaces[0] - 1]
    assert first >= 0 and L.names[first] == "grad.fc.input" and L.sizes[first] == T * IN * B
