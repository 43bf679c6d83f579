"""Backward in two halves, for zero-bubble schedules: input gradients now, weight gradients later.

The input half (``I``) is ``torch.autograd.grad`` from the stage's outputs to its inputs with the
graph retained: autograd runs only the nodes on paths to the inputs and, inside each, computes only
the outputs those paths need (a matmul computes ``dX``, not ``dW``). The weight half (``W``) must
then deliver exactly the gradients the full backward would have given the parameters, once each:

* the *boundary* nodes are those the input half ran that also feed a parameter through an edge
  the input half skipped (the ``dW`` edge of a matmul). A pre-hook records the gradient each
  received during the input half;
* ``W`` re-enters each boundary node alone, with what it received, asking only for its skipped
  edges (one ``autograd.grad`` per node: a node reached from another boundary node's inputs
  would otherwise be counted twice; a node whose child other boundary nodes feed too is called
  directly instead, since autograd would walk every path into that child), then runs one
  backward from those edges down to the parameters -- through FSDP's unsharded-parameter node,
  whose backward thus runs once per micro-batch as in a full backward.

A parameter used twice on the input path (tied weights) would be reached from both uses'
nodes: then ``W`` is one whole backward to the parameters (correct, at a full backward's cost).
A stage whose inputs need no gradient (the first stage: token ids) has no input half; its weight
half is the whole backward. Outputs that do not depend on the inputs at all join ``W`` as roots.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["SplitBackward"]


def _children(node):
    return [(c, nr) for c, nr in node.next_functions if c is not None]


def _all_nodes(roots) -> set:
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(c for c, _ in _children(node) if c not in seen)
    return seen


def _reaching(roots, targets: set) -> set:
    """Nodes reachable from ``roots`` that lead to a node of ``targets`` (targets included)."""
    seen, finished = set(), []
    stack = [(n, False) for n in roots]
    while stack:  # iterative post-order: a deep stage's graph overflows Python's recursion
        node, expanded = stack.pop()
        if expanded:
            finished.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c, _ in _children(node) if c not in seen)
    reach = set()
    for node in finished:  # children before parents
        if node in targets or any(c in reach for c, _ in _children(node)):
            reach.add(node)
    return reach


def _sum_to(grad, node, nr):
    if grad is None:
        return None
    shape = tuple(node._input_metadata[nr].shape)
    return grad if tuple(grad.shape) == shape else grad.sum_to_size(shape)


class SplitBackward:
    """One micro-batch's backward of one stage, run as ``input_grads()`` then ``weight_grads()``."""

    def __init__(self, outputs: list[torch.Tensor], grads: list, inputs: list[torch.Tensor]):
        self.outputs, self.grads = outputs, grads
        self.inputs = [x for x in inputs if x.requires_grad]
        self.captured: dict = {}
        self.boundary: dict = {}
        self.w_roots: list = []
        self.whole = False   # W is one backward from the outputs to the parameters
        self.shared: set = set()   # child nodes several boundary nodes feed
        self.leaves: list = []     # the parameters: every other leaf the outputs reach

    def input_grads(self) -> list:
        """Gradients of ``inputs`` (None where one needs none); keeps what ``W`` needs."""
        if not self.inputs:
            self.w_roots = list(zip(self.outputs, self.grads))
            return []
        roots = [o.grad_fn for o in self.outputs if o.grad_fn is not None]
        input_nodes = {get_gradient_edge(x).node for x in self.inputs}
        # the parameters are the graph's other leaves: the module's attributes may be stand-ins
        # by now (fsdp publishes fresh unsharded tensors when backward reaches a module)
        param_nodes = {n for n in _all_nodes(roots)
                       if hasattr(n, "variable") and n not in input_nodes}
        self.leaves = [n.variable for n in param_nodes]
        on_input_path = _reaching(roots, input_nodes)
        to_params = _reaching(roots, param_nodes)
        handles = []
        for node in on_input_path - input_nodes:
            skipped = [(c, nr) for c, nr in _children(node)
                       if c not in on_input_path and c in to_params]
            if skipped:
                self.boundary[node] = skipped
                handles.append(node.register_prehook(self._recorder(node)))
        edges = [e for skipped in self.boundary.values() for e in skipped]
        fed = [c for skipped in self.boundary.values() for c in {c for c, _ in skipped}]
        self.shared = {c for c in fed if fed.count(c) > 1}
        if len(edges) != len(set(edges)):
            # a parameter used twice on the input path (tied weights): re-entering one use's
            # node would also reach the other's -- run the whole weight backward instead
            for h in handles:
                h.remove()
            handles, self.boundary, self.whole = [], {}, True
        self.w_roots = [(o, g) for o, g in zip(self.outputs, self.grads)
                        if o.grad_fn is not None and o.grad_fn not in on_input_path
                        and o.grad_fn in to_params]
        try:
            grads = torch.autograd.grad(self.outputs, self.inputs, self.grads,
                                        retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        return list(grads)

    def _recorder(self, node):
        def record(grad_outputs):
            self.captured[node] = grad_outputs
        return record

    def weight_grads(self) -> None:
        """Accumulate the parameters' gradients (into ``.grad``, through any FSDP hooks)."""
        if self.whole:
            torch.autograd.backward(self.outputs, self.grads, inputs=self.leaves)
            self.outputs = self.grads = self.inputs = self.w_roots = self.leaves = None
            return
        totals: dict = {}
        for node, grad_outputs in self.captured.items():
            edges = self.boundary[node]
            seeds = [(GradientEdge(node, k), g) for k, g in enumerate(grad_outputs)
                     if g is not None]
            if not seeds:
                continue
            if any(c in self.shared for c, _ in edges) and len(seeds) == len(grad_outputs):
                # a child other boundary nodes feed too (fsdp's unsharded-parameter node, fed
                # by every norm weight): autograd would walk every path into it, so run this
                # node by hand -- all its outputs (for a norm's multiply, one more multiply)
                everything = node(*grad_outputs)
                position = {e: i for i, e in enumerate(node.next_functions)}
                # the engine would sum a broadcast operand's gradient to its shape: so do we
                got = [_sum_to(everything[position[e]], *e) for e in edges]
            else:
                got = torch.autograd.grad([e for e, _ in seeds],
                                          [GradientEdge(c, nr) for c, nr in edges],
                                          [g for _, g in seeds], retain_graph=True,
                                          allow_unused=True)
            for edge, g in zip(edges, got):
                if g is not None:
                    totals[edge] = g if edge not in totals else totals[edge] + g
        roots = [(GradientEdge(c, nr), g) for (c, nr), g in totals.items()]
        roots += [(o, g) for o, g in self.w_roots]
        self.captured = self.boundary = None
        if roots:
            torch.autograd.backward([r for r, _ in roots], [g for _, g in roots])
        self.outputs = self.grads = self.inputs = self.w_roots = self.leaves = None
