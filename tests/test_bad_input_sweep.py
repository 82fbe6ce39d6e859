"""A sweep of misuses across the public API: each raises at the boundary, naming the argument,
and the process stays usable (a valid round trip after every case)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.distributions as D
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


def _round_trip_still_works():
    d = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    np.testing.assert_array_equal(d.redistribute(MESH, [Replicate(), Shard(0)]).full_tensor().numpy(), X)


def _check(fn, exc, fragment):
    with pytest.raises(exc) as info:
        fn()
    if fragment:
        assert fragment.lower() in str(info.value).lower(), str(info.value)
    _round_trip_still_works()


@pytest.mark.parametrize("fn,exc,fragment", MESH_CASES + PLACEMENT_CASES + OP_CASES,
                         ids=[f"api-{i}" for i in range(len(MESH_CASES + PLACEMENT_CASES + OP_CASES))])
def test_api_misuse_is_refused_naming_the_argument(fn, exc, fragment):
    _check(fn, exc, fragment)


@pytest.mark.parametrize("family,kwargs,name", DIST_CASES, ids=[f"{c[0].__name__}-{c[2]}" for c in DIST_CASES])
def test_invalid_distribution_parameters_name_the_parameter(family, kwargs, name):
    _check(lambda: family(validate_args=True, **kwargs), ValueError, name)
