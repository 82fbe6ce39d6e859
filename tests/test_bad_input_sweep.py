"""A sweep of misuses across the public API: each raises at the boundary, naming the argument,
and the process stays usable (a valid round trip after every case)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.distributions as D
from bad_input_helpers import check_refused
from conftest import make_mesh
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import explain_redistribute

MESH = make_mesh((2, 4))
MESH1 = make_mesh((8,))
X = np.arange(48.0, dtype=np.float32).reshape(6, 8)


def _d():
    return distribute_tensor(X, MESH, [Shard(0), Shard(1)])


MESH_CASES = [
    (lambda: tfdist.init_device_mesh("cpu", (3,)), ValueError, "mesh_shape"),
    (lambda: tfdist.init_device_mesh("cpu", (0, 8)), ValueError, "mesh_shape"),
    (lambda: tfdist.init_device_mesh("cpu", (2, 2)), ValueError, "mesh_shape"),
    (lambda: tfdist.init_device_mesh("cpu", (-2, -4)), ValueError, "mesh_shape"),
    (lambda: tfdist.init_device_mesh("cpu", "8"), (ValueError, TypeError), "mesh_shape"),
    (lambda: tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("a",)), ValueError, "mesh_dim_names"),
    (lambda: tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "a")), ValueError, "mesh_dim_names"),
    (lambda: tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("a,b", "c")), ValueError, "mesh_dim_names"),
    (lambda: tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("", "c")), ValueError, "mesh_dim_names"),
    (lambda: tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=(1, 2)), ValueError, "mesh_dim_names"),
    (lambda: tfdist.init_device_mesh("quantum", (8,)), ValueError, "device_type"),
    (lambda: MESH["nope"], (KeyError, ValueError), "nope"),
    (lambda: MESH[("dp", "dp")], (KeyError, ValueError), "dp"),
    (lambda: MESH.size("zz"), (KeyError, ValueError), "zz"),
    (lambda: MESH.get_local_rank("zz"), (KeyError, ValueError), "zz"),
]

PLACEMENT_CASES = [
    (lambda: Shard("0"), (TypeError, ValueError), "dim"),
    (lambda: Shard(1.5), (TypeError, ValueError), "dim"),
    (lambda: Partial("bogus"), ValueError, "reduce_op"),
    (lambda: Partial(3), (TypeError, ValueError), "reduce_op"),
    (lambda: distribute_tensor(X, MESH, [Shard(2), Replicate()]), ValueError, "Shard"),
    (lambda: distribute_tensor(X, MESH, [Shard(-3), Replicate()]), ValueError, "Shard"),
    (lambda: distribute_tensor(X, MESH, [Shard(0)]), ValueError, "placements"),
    (lambda: distribute_tensor(X, MESH, [Shard(0), Shard(1), Replicate()]), ValueError, "placements"),
    (lambda: distribute_tensor(X, MESH, [Partial(), Replicate()]), ValueError, "Partial"),
    (lambda: distribute_tensor(X, MESH, ["S0", Replicate()]), (TypeError, ValueError), "placements"),
    (lambda: distribute_tensor(X, "mesh", [Replicate(), Replicate()]), TypeError, "device_mesh"),
    (lambda: distribute_tensor(X, MESH, [Replicate(), Replicate()], src_data_rank=5), ValueError, "src_data_rank"),
    (lambda: distribute_tensor(X, MESH, [Replicate(), Replicate()], src_data_rank=-1), ValueError, "src_data_rank"),
    (lambda: distribute_tensor(X, MESH, [Replicate(), Replicate()], src_data_rank="0"), ValueError,
     "src_data_rank"),
    (lambda: _d().redistribute(MESH, [Shard(0)]), ValueError, "placements"),
    (lambda: _d().redistribute(MESH, [Shard(4), Replicate()]), ValueError, "Shard"),
    (lambda: _d().redistribute(MESH1, [Replicate()]), ValueError, "mesh"),
    (lambda: _d().redistribute(MESH, [Partial("bogus"), Replicate()]), ValueError, "reduce_op"),
    (lambda: DTensor.from_local(np.ones((3, 2)), MESH, [Shard(0)]), ValueError, "placements"),
    (lambda: DTensor.from_local([np.ones((3, 2))] * 3, MESH, [Shard(0), Shard(1)]), ValueError, "local"),
    (lambda: DTensor.from_local([], MESH, [Shard(0), Shard(1)]), ValueError, "local"),
    (lambda: DTensor.from_local(np.ones((3, 2)), MESH, [Shard(0), Shard(1)], stride=(5, 5)), ValueError,
     "stride"),
    (lambda: explain_redistribute(_d(), MESH, [Shard(9), Replicate()]), ValueError, "Shard"),
    (lambda: _d() + tf.ones((6, 8)), TypeError, "lives on no mesh"),  # a scalar is fine, a plain tensor not
]


def _d64():
    return distribute_tensor(X.astype(np.float64), MESH, [Shard(0), Shard(1)])


OP_CASES = [
    (lambda: _d() + _d64(), TypeError, "float64"),
    (lambda: _d() @ distribute_tensor(np.ones((5, 3), np.float32), MESH, [Replicate(), Replicate()]),
     (ValueError, tf.errors.InvalidArgumentError), "shape"),
    (lambda: distribute_tensor(np.zeros([1] * 10, np.float32), MESH1, [Shard(0)]), ValueError, "rank"),
]

# kinds a new user meets (issue: messages): each names the argument and its received value
def _set_keras_distribution(value):
    import keras

    import tfdist.keras  # noqa: F401 - tfdist's Keras integration checks the value

    keras.distribution.set_distribution(value)


USER_CASES = [
    (lambda: MESH[0], TypeError, "received: 0"),
    (lambda: MESH[("dp", 1)], TypeError, "mesh dim names"),
    (lambda: tfdist.tensor.full((4, 4), "x", device_mesh=MESH, placements=[Shard(0), Replicate()]), TypeError,
     "fill_value='x'"),
    (lambda: D.Normal(loc="a", scale=1.0), TypeError, "loc='a'"),
    (lambda: D.Normal("a", 1.0), TypeError, "loc='a'"),
    (lambda: D.Bernoulli(probs={"p": 0.5}), TypeError, "probs="),
    (lambda: D.Normal(np.zeros(3), np.ones(4)), ValueError, "loc of shape (3,), scale of shape (4,)"),
    (lambda: D.Normal(np.zeros(3), np.ones(3)).log_prob(np.zeros(4)), ValueError, "value of shape (4,)"),
    (lambda: D.Normal(np.zeros(3), np.ones(3)).cdf(np.zeros((2, 4))), ValueError, "value of shape (2, 4)"),
    (lambda: D.kl_divergence(D.Normal(np.zeros(3), np.ones(3)), D.Normal(np.zeros(4), np.ones(4))), ValueError,
     "q.batch_shape=(4,)"),
    (lambda: D.kl_divergence(D.Normal(0.0, 1.0), "normal"), TypeError, "q of type str"),
    (lambda: D.Normal(np.zeros(3), np.ones(3)).expand((4,)), ValueError, "batch_shape=(4,)"),
    (lambda: D.Normal(np.zeros(3), np.ones(3)).expand("big"), (TypeError, ValueError), "batch_shape"),
    (lambda: D.transforms.LowerCholeskyTransform()(np.zeros(3)), ValueError, "x of shape (3,)"),
    (lambda: D.transforms.LowerCholeskyTransform().inv(np.zeros(3)), ValueError, "y of shape (3,)"),
    (lambda: _set_keras_distribution("bogus"), TypeError, "value='bogus' of type str"),
    (lambda: tfdist.tensor.zeros(4, layout="sparse_coo", device_mesh=MESH), ValueError, "layout='sparse_coo'"),
]

# (family, kwargs) whose parameters violate the family's constraint
DIST_CASES = [
    (D.Normal, dict(loc=0.0, scale=-1.0), "scale"),
    (D.Normal, dict(loc=float("nan"), scale=1.0), "loc"),
    (D.LogNormal, dict(loc=0.0, scale=0.0), "scale"),
    (D.HalfNormal, dict(scale=-2.0), "scale"),
    (D.Laplace, dict(loc=0.0, scale=-1.0), "scale"),
    (D.Cauchy, dict(loc=0.0, scale=-1.0), "scale"),
    (D.HalfCauchy, dict(scale=0.0), "scale"),
    (D.Gumbel, dict(loc=0.0, scale=-1.0), "scale"),
    (D.Exponential, dict(rate=-1.0), "rate"),
    (D.Gamma, dict(concentration=-1.0, rate=1.0), "concentration"),
    (D.Gamma, dict(concentration=1.0, rate=0.0), "rate"),
    (D.Chi2, dict(df=-1.0), "df"),
    (D.StudentT, dict(df=0.0), "df"),
    (D.Beta, dict(concentration1=-1.0, concentration0=1.0), "concentration1"),
    (D.Beta, dict(concentration1=1.0, concentration0=-1.0), "concentration0"),
    (D.Uniform, dict(low=1.0, high=0.0), "low"),
    (D.Pareto, dict(scale=-1.0, alpha=1.0), "scale"),
    (D.Weibull, dict(scale=1.0, concentration=-1.0), "concentration"),
    (D.Bernoulli, dict(probs=1.5), "probs"),
    (D.Bernoulli, dict(probs=-0.5), "probs"),
    (D.Geometric, dict(probs=0.0), "probs"),
    (D.Geometric, dict(probs=2.0), "probs"),
    (D.Binomial, dict(total_count=5, probs=1.5), "probs"),
    (D.Binomial, dict(total_count=-1, probs=0.5), "total_count"),
    (D.Poisson, dict(rate=-1.0), "rate"),
    (D.Categorical, dict(probs=[0.5, -0.5]), "probs"),
    (D.Dirichlet, dict(concentration=[1.0, -1.0]), "concentration"),
    (D.VonMises, dict(loc=0.0, concentration=-1.0), "concentration"),
    (D.Kumaraswamy, dict(concentration1=-1.0, concentration0=1.0), "concentration1"),
    (D.InverseGamma, dict(concentration=-1.0, rate=1.0), "concentration"),
    (D.MultivariateNormal, dict(loc=[0.0, 0.0], covariance_matrix=[[1.0, 2.0], [2.0, 1.0]]), "covariance_matrix"),
    (D.MultivariateNormal, dict(loc=[0.0, 0.0], scale_tril=[[1.0, 1.0], [0.0, 1.0]]), "scale_tril"),
]


def _checkpoint_cases():
    import tempfile

    import keras

    import tfdist.checkpoint as dcp
    import tfdist.keras
    from tfdist.checkpoint import format_utils
    from tfdist.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    root = tempfile.mkdtemp(prefix="tfdist-sweep-")
    saved, objects_only = f"{root}/saved", f"{root}/objects"
    dcp.save({"a": tf.constant(X)}, checkpoint_id=saved)
    dcp.save({"step": 1}, checkpoint_id=objects_only)
    two = f"{root}/two"
    dcp.save({"a": tf.ones(2), "b": tf.ones(3)}, checkpoint_id=two)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
    model.compile(optimizer="adam", loss="mse")
    return [
        (lambda: dcp.save([1], checkpoint_id=root), TypeError, "state_dict"),
        (lambda: dcp.save({"a": 1}), ValueError, "checkpoint_id"),
        (lambda: dcp.save({"a": 1}, checkpoint_id=123), ValueError, "checkpoint_id"),
        (lambda: dcp.save({"a": 1}, storage_writer="disk"), TypeError, "StorageWriter"),
        (lambda: dcp.save({"a": 1}, checkpoint_id=root, process_group=1), ValueError, "process_group"),
        (lambda: dcp.save({1: tf.ones(2)}, checkpoint_id=f"{root}/k"), TypeError, "keys must be str"),
        (lambda: dcp.save({"a.b": 1, "a": {"b": 2}}, checkpoint_id=f"{root}/k"), ValueError, "'a.b'"),
        (lambda: dcp.load({"a": tf.zeros_like(X), "b": tf.zeros(2)}, checkpoint_id=saved), KeyError, "'b'"),
        (lambda: dcp.load({"a": tf.zeros((8, 6))}, checkpoint_id=saved), ValueError, "'a' has shape"),
        (lambda: dcp.load({"a": tf.zeros((6, 8), tf.int32)}, checkpoint_id=saved), ValueError, "dtype"),
        (lambda: dcp.load({"a": "text"}, checkpoint_id=saved), TypeError, "'a'"),
        (lambda: dcp.load({"a": tf.zeros_like(X)}, checkpoint_id=f"{root}/none"), FileNotFoundError,
         "no checkpoint"),
        (lambda: dcp.load({"a": 1}, storage_reader=dcp.FileSystemWriter(saved)), TypeError, "StorageReader"),
        (lambda: dcp.FileSystemWriter(root, thread_count=0), ValueError, "thread_count"),
        (lambda: dcp.async_save({"a": 1}, checkpoint_id=root, async_checkpointer_type="process"),
         ValueError, "async_checkpointer_type='process'"),
        (lambda: get_model_state_dict(model, options=StateDictOptions(broadcast_from_rank0=True)), ValueError,
         "broadcast_from_rank0"),
        (lambda: get_model_state_dict(model, options={"full_state_dict": True}), TypeError, "options"),
        (lambda: get_model_state_dict(object()), TypeError, "model"),
        (lambda: set_model_state_dict(model, "weights"), TypeError, "model_state_dict"),
        (lambda: set_model_state_dict(model, {"dense.kernel": np.zeros((2, 4))},
                                      options=StateDictOptions(strict=False)), ValueError, "'dense.kernel'"),
        (lambda: set_optimizer_state_dict(model, model.optimizer, {"x": 1}), ValueError, "optim_state_dict"),
        (lambda: tfdist.keras.DistributedCheckpoint(root, save_freq="daily"), ValueError, "save_freq"),
        (lambda: tfdist.keras.DistributedCheckpoint(root, keep=-1), ValueError, "keep"),
        (lambda: format_utils.dcp_to_tf_checkpoint(objects_only, f"{root}/tf/x"), ValueError, "no tensors"),
        (lambda: format_utils.dcp_to_safetensors(two, f"{root}/x.safetensors", name_map=lambda k: "same"),
         ValueError, "name_map"),
    ]


CHECKPOINT_CASES = _checkpoint_cases()


@pytest.mark.parametrize("fn,exc,fragment", CHECKPOINT_CASES, ids=[f"ckpt-{i}" for i in range(len(CHECKPOINT_CASES))])
def test_checkpoint_misuse_is_refused_naming_the_argument(fn, exc, fragment):
    _check(fn, exc, fragment)


_check = check_refused  # refused clearly, and the process stays usable


@pytest.mark.parametrize("fn,exc,fragment", MESH_CASES + PLACEMENT_CASES + OP_CASES,
                         ids=[f"api-{i}" for i in range(len(MESH_CASES + PLACEMENT_CASES + OP_CASES))])
def test_api_misuse_is_refused_naming_the_argument(fn, exc, fragment):
    _check(fn, exc, fragment)


@pytest.mark.parametrize("fn,exc,fragment", USER_CASES, ids=[f"user-{i}" for i in range(len(USER_CASES))])
def test_what_new_users_pass_wrongly_is_refused_naming_the_argument(fn, exc, fragment):
    _check(fn, exc, fragment)


@pytest.mark.parametrize("family,kwargs,name", DIST_CASES, ids=[f"{c[0].__name__}-{c[2]}" for c in DIST_CASES])
def test_invalid_distribution_parameters_name_the_parameter(family, kwargs, name):
    _check(lambda: family(validate_args=True, **kwargs), ValueError, name)
