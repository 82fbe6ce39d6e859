"""When an FSDP group's all-gathers may start: torch's prefetch settings on TF's dataflow.

TF's executor runs an op as soon as its inputs and control inputs are ready.
FSDP makes each all-gather wait for its layer's input (forward) or its layer's
output gradient (the backward's gather again), so full parameters exist only
around their use and the gathers run in layer order.  Prefetching group B from
group A makes B's gathers wait for A's trigger instead -- in the forward, the
input of A's first layer; in the backward, the output gradient of A's first
layer to run its backward (torch's BACKWARD_PRE), or that layer's input
gradient (BACKWARD_POST) -- so B's gathers may run while A computes, and they
are issued in the order the prefetch lists give.  ``unshard()`` inside a
traced step drops the forward wait: the gathers may start with the step.

Triggers are tensors of the graph being traced; a trigger from another graph
(an earlier trace) is ignored.  Eager ops run in call order, so there is
nothing to reorder there.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["GatherOrder"]

_NO_WAIT = object()


def _graph():
    return tf.compat.v1.get_default_graph()


class GatherOrder:
    """One FSDP group's prefetch lists and the triggers other groups set for it.

    Example (group ``a`` prefetches group ``b`` in the forward)::

        a.forward_targets = [b]
        deps = a.forward_wait(x)      # [x]; b's gathers now wait for x too
        deps_b = b.forward_wait(y)    # [x], not [y]
    """

    def __init__(self) -> None:
        self.forward_targets: list[GatherOrder] = []
        self.backward_targets: list[GatherOrder] = []
        # what starts the groups this one prefetches in the backward: its layer's output gradient
        # ("pre", FSDP2 and FSDP1 BACKWARD_PRE), its input gradient ("post", BACKWARD_POST), or its
        # reduced gradient ("reduced", FSDP1 backward_prefetch=None: no prefetch, the next gather
        # issued after this group's reduce-scatter, as on torch's one communication stream)
        self.backward_at = "pre"
        self._forward: tuple[object, object] | None = None  # (graph, tensor or _NO_WAIT)
        self._backward: tuple[object, tf.Tensor, str] | None = None

    def forward_wait(self, own: tf.Tensor) -> list[tf.Tensor]:
        """The control inputs of this group's forward gather whose layer input is ``own``; the
        groups this one prefetches start with ``own`` (the first of this group's layers)."""
        if not tf.inside_function():
            return []
        graph = _graph()
        for target in self.forward_targets:
            if target._forward is None or target._forward[0] is not graph:
                target._forward = (graph, own)
        if self._forward is not None and self._forward[0] is graph:
            trigger = self._forward[1]
            return [] if trigger is _NO_WAIT else [trigger]
        return [own]

    def unshard_now(self) -> None:
        """This group's forward gathers in the step being traced wait for nothing."""
        if tf.inside_function():
            self._forward = (_graph(), _NO_WAIT)

    def backward_publish(self, zeros: tf.Tensor, *, at: str) -> None:
        """A layer of this group runs its backward: ``zeros`` (computed from its output gradient,
        ``at="pre"``; its input gradient, ``"post"``; or a reduced gradient, ``"reduced"``) starts the
        groups this one prefetches when ``at`` is this group's ``backward_at``."""
        if not tf.inside_function() or at != self.backward_at:
            return
        graph = _graph()
        for target in self.backward_targets:
            current = target._backward if target._backward is not None and target._backward[0] is graph else None
            if at == "reduced" and current is not None:  # after every reduction of the group, not only the last
                target._backward = (graph, current[1] + zeros, at)
            elif at != "pre" or current is None:
                target._backward = (graph, zeros, at)  # pre: the first layer's; post: the last one's

    def backward_tie(self, own: tf.Tensor) -> tf.Tensor:
        """The zeros this group's backward gather is tied to: a prefetching group's, else ``own``;
        after a "reduced" trigger both (no prefetch: the gather waits for its own layer too)."""
        if tf.inside_function() and self._backward is not None and self._backward[0] is _graph():
            _, zeros, at = self._backward
            return own + zeros if at == "reduced" else zeros
        return own
