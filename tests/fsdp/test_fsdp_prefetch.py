"""Prefetch control: ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``,
``unshard()`` and FSDP1's ``forward_prefetch`` / ``backward_prefetch`` decide what each all-gather
waits for in the traced step TF runs, hence when TF's executor may issue it; values are unchanged.

The order is read from the traced program's dependencies: an op runs only after its ancestors
(data and control inputs), so "B's gather does not wait for A's computation" is "A's op is not an
ancestor of B's gather"."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import no_global_distribution, sum_sq_grads  # noqa: F401
from tfdist.fsdp import BackwardPrefetch, fully_shard
from tfdist.fsdp import FullyShardedDataParallel as FSDP
from tfdist.fsdp.wrap import ModuleWrapPolicy
from tfdist.keras._data import gather_to_numpy

X = tf.constant(np.random.default_rng(5).standard_normal((16, 64)), tf.float32)
N = 8


def make():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(64, name=f"d{i}") for i in range(3)])


def shard_each(model):
    mesh = tfdist.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def ancestors(op) -> set:
    seen, stack = set(), [op]
    while stack:
        cur = stack.pop()
        for parent in [t.op for t in cur.inputs] + list(cur.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def bfs_up(op):
    """``op``'s ancestors, nearest first."""
    queue, seen = [op], {op}
    while queue:
        cur = queue.pop(0)
        yield cur
        for parent in [t.op for t in cur.inputs] + list(cur.control_inputs):
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)


class Program:
    """The traced forward + backward of sum(model(x)^2), and where each kernel is read and gathered."""

    def __init__(self, model, step=None):
        self.model = model
        fn = tf.function(step or (lambda x: sum_sq_grads(model, x)))
        self.graph = fn.get_concrete_function(X).graph
        self.grads = fn(X)

    def _reads(self, layer):
        handle = layer.kernel.value.handle if hasattr(layer.kernel.value, "handle") else layer.kernel._value.handle
        inner = [internal for external, internal in self.graph.captures if external is handle]
        return [c for t in inner for c in t.consumers() if c.type == "ReadVariableOp"]

    def _first_relayout_after(self, op):
        stack, seen = [op], set()
        while stack:
            cur = stack.pop(0)
            for out in cur.outputs:
                for c in out.consumers():
                    if c.type == "Relayout":
                        return c
                    if c not in seen:
                        seen.add(c)
                        stack.append(c)
        raise AssertionError(f"no gather after {op.name}")

    def forward_gather(self, layer):
        """The all-gather of ``layer``'s kernel in the forward (its read inside the layer's scope)."""
        read = next(r for r in self._reads(layer) if f"/{layer.name}" in r.name)
        return self._first_relayout_after(read)

    def backward_read(self, layer):
        return next(r for r in self._reads(layer) if f"/{layer.name}" not in r.name)

    def backward_gather(self, layer):
        return self._first_relayout_after(self.backward_read(layer))

    def forward_einsum(self, layer):
        return next(op for op in self.graph.get_operations()
                    if op.type == "Einsum" and f"/{layer.name}" in op.name)


def assert_values(program):
    """The gradients equal one device's.  Both are float32 sums over the batch, added in another
    order on the mesh: an entry's error follows the size of the terms summed, not its own, so the
    absolute tolerance scales with the gradient's largest entry (on an AMD EPYC host without
    AVX-512: 1.5e-5 off on entries of 0.1 that sit beside entries of 32)."""
    for a, b in zip(sum_sq_grads(make(), X), program.grads):
        expected = a.numpy()
        np.testing.assert_allclose(gather_to_numpy(b), expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_by_default_each_gather_waits_for_its_layer():
    model = shard_each(make())
    d0, d1, d2 = model.layers
    p = Program(model)
    assert p.forward_einsum(d0) in ancestors(p.forward_gather(d1))  # d1's gather waits for d0's output
    assert p.backward_read(d2) in ancestors(p.backward_gather(d1))  # and, backward, for d2's input gradient
    assert_values(p)


def test_forward_prefetch_lets_the_next_gather_start_with_this_module():
    model = shard_each(make())
    d0, d1, d2 = model.layers
    d0.set_modules_to_forward_prefetch([d1, d2])
    p = Program(model)
    for later in (d1, d2):
        gather = ancestors(p.forward_gather(later))
        assert p.forward_einsum(d0) not in gather and p.forward_einsum(d1) not in gather
    assert_values(p)


def test_backward_prefetch_lets_the_previous_gather_start_with_this_modules_backward():
    model = shard_each(make())
    d0, d1, d2 = model.layers
    d2.set_modules_to_backward_prefetch([d1])
    p = Program(model)
    assert p.backward_read(d2) not in ancestors(p.backward_gather(d1))  # before d2's input gradient
    assert p.backward_read(d1) in ancestors(p.backward_gather(d0))  # d0 not prefetched: waits for d1
    assert_values(p)


def test_unshard_in_the_step_drops_the_wait():
    model = shard_each(make())
    d0, d1, d2 = model.layers

    def step(x):
        d2.unshard()
        return sum_sq_grads(model, x)

    p = Program(model, step)
    gather = p.forward_gather(d2)
    assert not gather.control_inputs and p.forward_einsum(d0) not in ancestors(gather)
    assert p.forward_einsum(d0) in ancestors(p.forward_gather(d1))
    assert d2.unshard(async_op=True).wait() is None  # eager: nothing to reorder
    assert_values(p)


@pytest.mark.parametrize("backward", [BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST, None],
                         ids=lambda b: getattr(b, "name", "none"))
def test_fsdp1_prefetch_arguments(backward):
    """FSDP1 with each Dense a unit: forward_prefetch=True chains the units in the forward;
    BACKWARD_PRE lets d1's backward gather start with d2's backward, BACKWARD_POST after d2's
    input gradient, None (no prefetch) after d2's kernel gradient is reduce-scattered, as torch
    issues d1's gather after d2's reduce-scatter on its one communication stream."""
    keras.utils.set_random_seed(0)
    model = FSDP(make(), auto_wrap_policy=ModuleWrapPolicy({keras.layers.Dense}), forward_prefetch=True,
                 backward_prefetch=backward, device_mesh=tfdist.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",)))
    d0, d1, d2 = model.layers
    p = Program(model)
    assert p.forward_einsum(d0) not in ancestors(p.forward_gather(d1))
    d1_gather = ancestors(p.backward_gather(d1))
    d2_backward = p.backward_read(d2)  # d2's gather again: precedes d2's input gradient
    assert (d2_backward in d1_gather) == (backward != BackwardPrefetch.BACKWARD_PRE)
    # the step's outputs are the gradients in trainable-variable order: d2's kernel is the 5th;
    # its reduce-scatter ends in the local sum after the all-to-all
    d2_reduced = next(op for op in bfs_up(p.graph.outputs[4].op) if op.type == "Sum")
    assert (d2_reduced in d1_gather) == (backward is None)
    assert_values(p)


def test_bad_prefetch_lists():
    model = shard_each(make())
    with pytest.raises(ValueError, match="set_modules_to_forward_prefetch.*Received"):
        model.layers[0].set_modules_to_forward_prefetch([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="backward_prefetch must be a BackwardPrefetch"):
        FSDP(make(), backward_prefetch="pre")
