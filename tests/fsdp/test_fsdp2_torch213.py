"""torch 2.13's FSDP2 additions: the gradient divide factor (for every layer), the reduction
settings with no TF counterpart (checked, kept, no effect), ``dp_mesh_dims`` and per-parameter
meshes (``ShardPlacementResult``).  References: one device's training with the learning rate the
factor implies, and the layouts a 1-D ``fully_shard`` gives."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
from keras_helpers import float64, max_weight_diff  # noqa: F401
from tfdist.fsdp import (
    DataParallelMeshDims, FSDPMeshInfo, ShardPlacementResult, fully_shard,
)
from tfdist.models import gpt_tp_plan
from tfdist.tensor import Shard
from tfdist.tensor.parallel import parallelize_module
from test_fully_shard import IDS, NEXT, SCE, X, Y, dp_mesh, fit, local_shape, make_gpt, make_mlp, shard_gpt


def sgd_fit(model, lr, steps=2):
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=SCE)
    return model.fit(IDS[:16 * steps], NEXT[:16 * steps], batch_size=16, epochs=1, verbose=0,
                     shuffle=False).history["loss"]


@pytest.mark.parametrize("factor", [2.0, 16.0])
def test_gradient_divide_factor_scales_every_parameters_gradient_by_n_over_f(float64, factor):
    """torch divides the sum of the 8 devices' gradients by ``f`` instead of 8: the gradient is
    ``8 / f`` times one device's mean gradient, for the GPT's dense, einsum, norm, embedding and
    whole-kept parameters alike -- SGD(lr) trains as one device with SGD(lr * 8 / f).  Before
    torch 2.13's rename tfdist scaled the Dense outputs' gradient, which also reached the layers
    below (and compounded); this pins down one factor per parameter."""
    lr = 0.05
    ref = make_gpt()
    ref_loss = sgd_fit(ref, lr * 8 / factor)
    model = shard_gpt(make_gpt(), dp_mesh())
    for block in model.blocks:
        block.set_gradient_divide_factor(factor)
    model.set_gradient_divide_factor(factor)
    loss = sgd_fit(model, lr)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)  # Keras' loss tracker is float32
    assert max_weight_diff(ref, model) < 1e-11


def test_divide_factor_then_hook_and_the_deprecated_name(float64):
    """The hook gets the divided gradient (torch's order): factor 4 (x2) then a hook halving it
    trains as one device; ``set_reduce_scatter_divide_factor`` says it is deprecated and sets the
    same factor."""
    ref = make_mlp()
    ref_loss = fit(ref, X[:32], Y[:32], "mse", epochs=1)
    model = fully_shard(make_mlp(), mesh=dp_mesh())
    with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
        model.set_reduce_scatter_divide_factor(4)
    model.set_all_reduce_hook(lambda grad: grad * 0.5)
    np.testing.assert_allclose(fit(model, X[:32], Y[:32], "mse", epochs=1), ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    for bad in (0, -1.0, True, "2"):
        with pytest.raises(ValueError, match=r"set_gradient_divide_factor\(factor\).*Received: factor="):
            model.set_gradient_divide_factor(bad)


def test_reduction_settings_without_a_tf_counterpart_are_checked_kept_and_change_nothing(float64):
    ref = make_mlp()
    ref_loss = fit(ref, X[:32], Y[:32], "mse", epochs=1)
    model = make_mlp()
    fully_shard(model.get_layer("up"), mesh=dp_mesh())
    fully_shard(model, mesh=dp_mesh())
    model.set_reduce_scatter_max_input_buffers(3)
    model.set_separate_reduce_scatter_group()
    model.set_force_sum_reduction_for_comms(True)
    states = [model._fsdp_state, model.get_layer("up")._fsdp_state]
    assert [s.reduce_scatter_max_input_buffers for s in states] == [3, 3]  # recurse=True reaches the child
    assert [s.separate_reduce_scatter_group for s in states] == [True, True]
    model.get_layer("up").set_reduce_scatter_max_input_buffers(1, recurse=False)
    assert [s.reduce_scatter_max_input_buffers for s in states] == [3, 1]
    np.testing.assert_allclose(fit(model, X[:32], Y[:32], "mse", epochs=1), ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    with pytest.raises(TypeError, match="max_input_buffers must be an int, got bool"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="max_input_buffers must be a positive int, got 0"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match=r"set_force_sum_reduction_for_comms\(enable\).*Received: enable='yes'"):
        model.set_force_sum_reduction_for_comms("yes")
    with pytest.raises(TypeError, match=r"set_separate_reduce_scatter_group\(enable\).*Received: enable=1"):
        model.set_separate_reduce_scatter_group(1)


def test_dp_mesh_dims_shard_names_the_dim_of_the_full_mesh():
    """``mesh=`` the full (dp, tp) mesh with ``DataParallelMeshDims(shard="dp")`` shards as
    ``mesh["dp"]`` does: FSDP's dp on the dim tensor parallel left free."""
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = make_gpt()
    parallelize_module(model, mesh["tp"], gpt_tp_plan())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert local_shape(model.blocks[0].mlp.up.kernel) == (8, 16)  # [16, 64]: dp on 0, tp on 1
    assert local_shape(model.blocks[0].mlp.down.kernel) == (16, 8)  # [64, 16]: tp on 0, dp on 1


def test_dp_mesh_dims_fit_equals_one_device_and_bad_dims_are_refused(float64):
    ref = make_mlp()
    ref_loss = fit(ref, X[:32], Y[:32], "mse", epochs=1)
    mesh = tfdist.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "other"))
    model = fully_shard(make_mlp(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert local_shape(model.get_layer("up").kernel) == (4, 32)  # [16, 32] over dp=4
    np.testing.assert_allclose(fit(model, X[:32], Y[:32], "mse", epochs=1), ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    refused = {
        DataParallelMeshDims(replicate="dp"): "DistributedDataParallel",
        DataParallelMeshDims(shard=("dp", "other")): "flattens 2 mesh dims",
        DataParallelMeshDims(shard="tp"): "not a dim of the mesh",
    }
    for dims, said in refused.items():
        with pytest.raises(ValueError, match=said):
            fully_shard(make_mlp(), mesh=mesh, dp_mesh_dims=dims)
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()
    with pytest.raises(TypeError, match="dp_mesh_dims must be a DataParallelMeshDims"):
        fully_shard(make_mlp(), mesh=mesh, dp_mesh_dims="dp")


def test_shard_placement_result_on_the_groups_own_dim_and_other_meshes_refused(float64):
    """A per-parameter mesh naming the group's dp dim is its placement (here dim 1 of the kernel);
    another mesh dim (the MoE case) would need the batch sharded over it too, refused by name."""
    mesh = dp_mesh()

    def on_dim_1(variable):
        return ShardPlacementResult(Shard(1), FSDPMeshInfo(mesh, shard_mesh_dim=0)) if variable.shape[1:] == (32,) \
            else None

    model = fully_shard(make_mlp(), mesh=mesh, shard_placement_fn=on_dim_1)
    assert local_shape(model.get_layer("up").kernel) == (16, 4)  # [16, 32] on dim 1
    ref = make_mlp()
    np.testing.assert_allclose(fit(model, X[:32], Y[:32], "mse", epochs=1),
                               fit(ref, X[:32], Y[:32], "mse", epochs=1), rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    two = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "b"))
    for info, said in ((FSDPMeshInfo(two, shard_mesh_dim=1), r"own mesh dims \(shard 'b' of"),
                       (FSDPMeshInfo(two, shard_mesh_dim=1, replicate_mesh_dim=0), "replicate 'a'")):
        with pytest.raises(ValueError, match=said):
            fully_shard(make_mlp(), mesh=mesh, shard_placement_fn=lambda v, info=info: ShardPlacementResult(None, info))
    with pytest.raises(ValueError, match="shard_mesh_dim=5"):
        FSDPMeshInfo(mesh, shard_mesh_dim=5)
