"""The route to HSDP past the refusal in docs/tf_dtensor_repros/hsdp_batch_two_mesh_dims.py (part 2):
TF's vectoriser has no converter for DTensor's ``Relayout`` op, but one can be registered
(``pfor.RegisterPFor``): a relayout of a stacked per-group value is the relayout of the stacked
tensor with its leading axis laid out on the replicate mesh dim.  With it a replica group's
FSDP-over-"s" program -- the weight gathered over "s" inside the vectorised function -- builds,
runs and differentiates on a (r, s) mesh, the gradient equal to numpy's.  HSDP in ``fully_shard``
is not built on it yet (issue notes, docs/design.md); this pins down that the TF side holds."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.ops.parallel_for import pfor

U = dtensor.UNSHARDED
REPLICATE = "r"


def _relayout_stacked(pfor_input):
    t = pfor_input.stacked_input(0)
    layout = dtensor.Layout.from_string(pfor_input.get_attr("layout"))
    return pfor.wrap(dtensor.relayout(t, dtensor.Layout([REPLICATE, *layout.sharding_specs], layout.mesh)), True)


@pytest.fixture
def relayout_converter():
    """The converter, registered for this test only (TF 2.21 has none: the repro's part 2), so the
    other tests of the process see TF's own vectoriser."""
    assert "Relayout" not in pfor._pfor_converter_registry
    pfor.RegisterPFor("Relayout")(_relayout_stacked)
    yield
    pfor._pfor_converter_registry.pop("Relayout")


def test_a_registered_relayout_converter_vectorises_fsdp_groups_over_the_replicate_dim(relayout_converter):
    """[R, B/R, in] laid out (r, s, -): each group gathers the "s"-sharded weight and computes its
    rows; the loss and the weight gradient (kept on "s") equal one device's computation in numpy."""
    mesh = dtensor.create_mesh([("r", 2), ("s", 4)], device_type="CPU")
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((2, 8, 16)).astype("float32")
    ws = (rng.standard_normal((16, 4)) * 0.3).astype("float32")
    x = dtensor.pack([xs[i // 4:i // 4 + 1, (i % 4) * 2:(i % 4) * 2 + 2] for i in range(8)],
                     dtensor.Layout(["r", "s", U], mesh))
    w = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(ws), dtensor.Layout.replicated(mesh, 2)),
                         dtensor.Layout(["s", U], mesh))  # FSDP storage: sharded on s, replicated on r

    @tf.function
    def step(x, w):
        def group(rows):
            full = dtensor.relayout(w, dtensor.Layout([U, U], mesh))  # the FSDP all-gather over s
            return tf.reduce_sum(tf.tanh(rows @ full) ** 2)

        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_sum(tf.vectorized_map(group, x, fallback_to_while_loop=False))
        return loss, tape.gradient(loss, w)

    loss, grad = step(x, w)
    rows = xs.reshape(16, 16)
    h = np.tanh(rows @ ws)
    np.testing.assert_allclose(float(dtensor.unpack(loss)[0]), float((h ** 2).sum()), rtol=1e-5)
    expected = rows.T @ (2 * h * (1 - h ** 2))  # d/dW sum(tanh(XW)^2)
    assert dtensor.fetch_layout(grad).sharding_specs == ["s", U]
    np.testing.assert_allclose(tf.concat(dtensor.unpack(grad)[:4], 0).numpy(), expected, rtol=1e-4, atol=1e-5)
