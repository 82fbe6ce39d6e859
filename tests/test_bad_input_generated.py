"""A generated sweep of misuses: every placement-taking API x every kind of bad placement, the
factories' sizes, meshes, seeds, and each distribution parameter set to NaN or out of its
support.  Each raises at the boundary naming the argument, and a valid round trip runs after it
in the same process (nothing half-converted, nothing poisoned)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import tfdist
import tfdist.distributions as D
from bad_input_helpers import check_refused
from conftest import make_mesh
from tfdist import tensor as T
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import explain_redistribute

MESH = make_mesh((2, 4))
MESH1 = make_mesh((8,))
X = np.arange(48.0, dtype=np.float32).reshape(6, 8)


_check = check_refused  # refused clearly, and the process stays usable


# -- every placement-taking API x every bad placement list ------------------------------------
# (placements for the 2x4 mesh, the exception, a fragment the message must contain)
BAD_PLACEMENTS = [
    ((Shard(2), Replicate()), ValueError, "shard"),          # dim out of range for rank 2
    ((Replicate(), Shard(-3)), ValueError, "shard"),
    ((Shard(7), Shard(0)), ValueError, "shard"),
    ((Shard(0),), ValueError, "placements"),                 # one per mesh dim
    ((Shard(0), Shard(1), Replicate()), ValueError, "placements"),
    ((), ValueError, "placements"),
    (("S0", Replicate()), (TypeError, ValueError), "placements"),
    ((0, Replicate()), (TypeError, ValueError), "placements"),
    ((None, Replicate()), (TypeError, ValueError), "placements"),
]


def _api_calls(placements):
    """name -> a call of a placement-taking API on a 2x4 mesh with ``placements``."""
    src = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    return {
        "distribute_tensor": lambda: distribute_tensor(X, MESH, placements),
        "redistribute": lambda: src.redistribute(MESH, placements),
        "from_local": lambda: DTensor.from_local(np.ones((3, 2), np.float32), MESH, placements),
        "explain_redistribute": lambda: explain_redistribute(src, MESH, placements),
        "zeros": lambda: T.zeros(6, 8, device_mesh=MESH, placements=placements),
        "ones": lambda: T.ones(6, 8, device_mesh=MESH, placements=placements),
        "full": lambda: T.full((6, 8), 2.0, device_mesh=MESH, placements=placements),
        "rand": lambda: T.rand(6, 8, device_mesh=MESH, placements=placements),
        "randn": lambda: T.randn(6, 8, device_mesh=MESH, placements=placements),
    }


API_NAMES = list(_api_calls((Replicate(), Replicate())))
PLACEMENT_CASES = list(itertools.product(API_NAMES, range(len(BAD_PLACEMENTS))))


@pytest.mark.parametrize("api, case", PLACEMENT_CASES, ids=[f"{a}-{c}" for a, c in PLACEMENT_CASES])
def test_bad_placements_are_refused_by_every_api(api, case):
    placements, exc, fragment = BAD_PLACEMENTS[case]
    _check(_api_calls(list(placements))[api], exc, fragment)


PARTIAL_MAKERS = ["distribute_tensor", "zeros", "ones", "full", "rand", "randn"]


@pytest.mark.parametrize("api", PARTIAL_MAKERS)
def test_partial_cannot_be_made_from_a_full_value(api):
    """torch: Partial only comes from operators (or from_local); makers refuse it."""
    _check(_api_calls([Partial(), Replicate()])[api], ValueError, "partial")


# -- factory sizes -----------------------------------------------------------------------------
FACTORIES = {
    "zeros": lambda size: T.zeros(*size, device_mesh=MESH1, placements=[Shard(0)]),
    "ones": lambda size: T.ones(*size, device_mesh=MESH1, placements=[Shard(0)]),
    "empty": lambda size: T.empty(*size, device_mesh=MESH1, placements=[Shard(0)]),
    "rand": lambda size: T.rand(*size, device_mesh=MESH1, placements=[Shard(0)]),
    "randn": lambda size: T.randn(*size, device_mesh=MESH1, placements=[Shard(0)]),
    "full": lambda size: T.full(size, 1.0, device_mesh=MESH1, placements=[Shard(0)]),
}
BAD_SIZES = [(-1, 4), (8, -2), (8.5, 4), ("8", 4), (8, None)]
SIZE_CASES = list(itertools.product(FACTORIES, range(len(BAD_SIZES))))


@pytest.mark.parametrize("factory, case", SIZE_CASES, ids=[f"{f}-{c}" for f, c in SIZE_CASES])
def test_factories_refuse_bad_sizes(factory, case):
    _check(lambda: FACTORIES[factory](BAD_SIZES[case]), (TypeError, ValueError), "size")


# -- meshes and seeds ------------------------------------------------------------------------------
MESH_CASES = [
    (lambda: tfdist.DeviceMesh("cpu", [0, 0, 1, 2]), ValueError, "mesh"),
    (lambda: tfdist.DeviceMesh("cpu", [0, 1, 2, 99]), ValueError, "99"),
    (lambda: tfdist.DeviceMesh("cpu", [[0, 1], [2]]), (ValueError, TypeError), "mesh"),
    (lambda: tfdist.DeviceMesh("cpu", ["a", "b"]), ValueError, "mesh"),
    (lambda: tfdist.DeviceMesh("cpu", 3), ValueError, "mesh"),
    (lambda: tfdist.DeviceMesh("cpu", [0, 1], mesh_dim_names=("a", "b")), ValueError, "mesh_dim_names"),
    (lambda: tfdist.DeviceMesh("tpu-v9", [0, 1]), ValueError, "device_type"),
    (lambda: MESH.size(5), (IndexError, ValueError), "5"),
    (lambda: MESH["dp", "zz"], (KeyError, ValueError), "zz"),
    (lambda: tfdist.manual_seed("seven"), (TypeError, ValueError), "seed"),
    (lambda: tfdist.manual_seed(1.5), (TypeError, ValueError), "seed"),
]


@pytest.mark.parametrize("fn, exc, fragment", MESH_CASES, ids=[f"mesh-{i}" for i in range(len(MESH_CASES))])
def test_mesh_and_seed_misuse(fn, exc, fragment):
    _check(fn, exc, fragment)


# -- distributions: each parameter NaN, and out of its support ----------------------------------------
VALID = [
    (D.Normal, dict(loc=0.0, scale=1.0)), (D.LogNormal, dict(loc=0.0, scale=1.0)),
    (D.HalfNormal, dict(scale=1.0)), (D.Laplace, dict(loc=0.0, scale=1.0)),
    (D.Cauchy, dict(loc=0.0, scale=1.0)), (D.HalfCauchy, dict(scale=1.0)),
    (D.Gumbel, dict(loc=0.0, scale=1.0)), (D.Exponential, dict(rate=1.0)),
    (D.Gamma, dict(concentration=2.0, rate=1.0)), (D.Chi2, dict(df=3.0)),
    (D.StudentT, dict(df=3.0, loc=0.0, scale=1.0)), (D.Beta, dict(concentration1=2.0, concentration0=2.0)),
    (D.Pareto, dict(scale=1.0, alpha=2.0)), (D.Weibull, dict(scale=1.0, concentration=2.0)),
    (D.Poisson, dict(rate=2.0)), (D.VonMises, dict(loc=0.0, concentration=1.0)),
    (D.Kumaraswamy, dict(concentration1=2.0, concentration0=2.0)),
    (D.InverseGamma, dict(concentration=2.0, rate=1.0)), (D.FisherSnedecor, dict(df1=3.0, df2=4.0)),
]
NAN_CASES = [(family, kwargs, name) for family, kwargs in VALID for name in kwargs]
# a value outside the support of each positive parameter
NEGATIVE_CASES = [(family, kwargs, name) for family, kwargs in VALID for name in kwargs
                  if name not in ("loc",) and not (family is D.VonMises and name == "loc")]


@pytest.mark.parametrize("family, kwargs, name", NAN_CASES, ids=[f"{f.__name__}-{n}" for f, _, n in NAN_CASES])
def test_a_nan_parameter_is_named(family, kwargs, name):
    bad = dict(kwargs, **{name: float("nan")})
    _check(lambda: family(validate_args=True, **bad), ValueError, name)


@pytest.mark.parametrize("family, kwargs, name", NEGATIVE_CASES,
                         ids=[f"{f.__name__}-{n}" for f, _, n in NEGATIVE_CASES])
def test_a_negative_positive_parameter_is_named(family, kwargs, name):
    bad = dict(kwargs, **{name: -1.0})
    _check(lambda: family(validate_args=True, **bad), ValueError, name)


@pytest.mark.parametrize("family, kwargs", VALID, ids=[f.__name__ for f, _ in VALID])
def test_a_value_outside_the_support_is_named_in_log_prob(family, kwargs):
    """validate_args: log_prob of a value outside the support names the support, as torch."""
    dist = family(validate_args=True, **kwargs)
    _check(lambda: dist.log_prob(float("nan")), ValueError, "support")


DISCRETE = [
    (D.Bernoulli, dict(probs=0.3), 0.5), (D.Bernoulli, dict(probs=0.3), 2.0),
    (D.Geometric, dict(probs=0.3), 0.5), (D.Geometric, dict(probs=0.3), -1.0),
    (D.Binomial, dict(total_count=5.0, probs=0.3), 6.0), (D.Binomial, dict(total_count=5.0, probs=0.3), 0.5),
    (D.Poisson, dict(rate=2.0), -1.0), (D.Poisson, dict(rate=2.0), 0.5),
    (D.NegativeBinomial, dict(total_count=3.0, probs=0.3), 0.5),
    (D.Categorical, dict(probs=[0.2, 0.8]), 2.0), (D.Categorical, dict(probs=[0.2, 0.8]), -1.0),
    (D.Uniform, dict(low=0.0, high=1.0), 2.0), (D.Beta, dict(concentration1=2.0, concentration0=2.0), 1.5),
    (D.Exponential, dict(rate=1.0), -1.0), (D.HalfNormal, dict(scale=1.0), -1.0),
]


@pytest.mark.parametrize("family, kwargs, value", DISCRETE, ids=[f"{f.__name__}-{v}" for f, _, v in DISCRETE])
def test_a_value_outside_a_support_is_refused(family, kwargs, value):
    dist = family(validate_args=True, **kwargs)
    _check(lambda: dist.log_prob(value), ValueError, "support")
