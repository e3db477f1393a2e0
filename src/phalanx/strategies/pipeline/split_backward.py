"""A backward in two parts, for the zero-bubble schedule: the input gradients now (B), the weight gradients later (W).

B runs autograd from the chunk's outputs to its inputs only: nodes compute only the gradients that lead to an
input, so a linear layer computes dX and not dW. While B runs, a pre-hook on each node of that path that also
leads to parameters (the matmul whose other operand is a weight, say) keeps the gradient arriving at it. W then
starts autograd at those nodes with the kept gradients, asking only for the parameters: each node runs once more,
computing only its parameter side. The parameters' gradients accumulate as a plain backward's would (their
``.grad`` and the data-parallel hooks), and W costs what the weight side of the backward costs, not a second
backward.

Parameters reached by two such nodes (a weight used twice) are computed together, with each node's input pinned
to its kept gradient, so no path is counted twice. Parameters that no path to an input reaches (a chunk whose
inputs need no gradient, such as the first, or an output that depends on weights alone) are left to W, which
runs the whole backward for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["DeferredWeights", "backward_inputs"]


def _node_of(t: torch.Tensor) -> Node | None:
    """The autograd node that receives ``t``'s gradient: its grad_fn, or the accumulator of a leaf."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]  # the leaf's AccumulateGrad


def _reaching(roots: list[Node], targets: set[Node]) -> set[Node]:
    """The nodes under ``roots`` from which some node of ``targets`` can be reached (targets included)."""
    reach: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            reach[node] = node in targets or any(
                reach.get(child, False) for child, _ in node.next_functions if child is not None
            )
            continue
        if node in reach:
            continue
        reach[node] = False  # being visited; an autograd graph has no cycles
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in reach)
    return {n for n, r in reach.items() if r}


class DeferredWeights:
    """The weight-gradient half of one micro-batch's backward on one chunk, kept from B until W."""

    def __init__(
        self,
        groups: list[tuple[list[Node], list[torch.Tensor]]],
        kept: dict[Node, tuple[torch.Tensor | None, ...]],
        rest: list[torch.Tensor],
        roots: list[torch.Tensor],
        root_grads: list[torch.Tensor | None],
    ) -> None:
        self.groups, self.kept, self.rest = groups, kept, rest
        self.roots, self.root_grads = roots, root_grads

    def run(self) -> None:
        """Accumulate the parameters' gradients; the graph is let go afterwards."""
        for nodes, params in self.groups:
            edges, grads = [], []
            for node in nodes:
                for k, g in enumerate(self.kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(g)
            if not edges:
                continue  # no gradient reached these nodes: their parameters get none, as in a plain backward
            pins = []
            if len(nodes) > 1:  # one node may lie under another: it takes its kept gradient, not a second sum
                pins = [n.register_prehook(lambda _, g=self.kept[n]: g) for n in nodes if n in self.kept]
            try:
                torch.autograd.backward(edges, grad_tensors=grads, inputs=params, retain_graph=True)
            finally:
                for h in pins:
                    h.remove()
        if self.rest:
            torch.autograd.backward(self.roots, grad_tensors=self.root_grads, inputs=self.rest, retain_graph=True)
        self.groups, self.kept, self.rest, self.roots, self.root_grads = [], {}, [], [], []


def backward_inputs(
    roots: list[torch.Tensor],
    root_grads: list[torch.Tensor | None],
    inputs: list[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], DeferredWeights]:
    """B: the gradients of ``inputs`` (None where none flows), and the W that gives ``params`` theirs."""
    inputs = [t for t in inputs if t.requires_grad]
    if not roots:
        return [None] * len(inputs), DeferredWeights([], {}, [], [], [])
    if not inputs:  # nothing to send back: all of the backward is W
        return [], DeferredWeights([], {}, [p for p in params if p.requires_grad], roots, root_grads)  # no inputs
    root_nodes = [n for n in map(_node_of, roots) if n is not None]
    input_nodes = {n for n in map(_node_of, inputs) if n is not None}
    param_of: dict[Node, torch.Tensor] = {}
    for param in params:
        acc = _node_of(param) if param.requires_grad else None
        if acc is not None:
            param_of[acc] = param
    on_path = _reaching(root_nodes, input_nodes)
    # For each node on the path to the inputs, the parameters reached through its other children.
    below: dict[Node, set[Node]] = {}
    for node in on_path:
        side = [child for child, _ in node.next_functions if child is not None and child not in on_path]
        if side:
            hit = _reaching(side, set(param_of)) & set(param_of)
            if hit:
                below[node] = hit
    # Nodes that share a parameter form one group (union by parameter).
    owner: dict[Node, Node] = {}
    groups: dict[Node, tuple[list[Node], set[Node]]] = {}
    for node, hit in below.items():
        merged_nodes, merged_params = [node], set(hit)
        for p in hit:
            g = owner.get(p)
            if g is not None and g in groups:
                nodes, ps = groups.pop(g)
                merged_nodes += nodes
                merged_params |= ps
        groups[node] = (merged_nodes, merged_params)
        for p in merged_params:
            owner[p] = node
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node in below:

        def keep(grad_outputs: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
            kept[node] = grad_outputs

        handles.append(node.register_prehook(keep))
    try:
        grads: list[torch.Tensor | None] = list(
            torch.autograd.grad(roots, inputs, root_grads, retain_graph=True, allow_unused=True)
        )
    finally:
        for h in handles:
            h.remove()
    covered = {p for _, ps in groups.values() for p in ps}
    reached = _reaching(root_nodes, set(param_of)) & set(param_of)
    rest = [param_of[p] for p in reached - covered]
    work = [(nodes, [param_of[p] for p in ps]) for nodes, ps in groups.values()]
    return grads, DeferredWeights(work, kept, rest, roots if rest else [], root_grads if rest else [])
