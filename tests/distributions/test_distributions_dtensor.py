"""Distributions whose parameters are DTensors sharded on a batch dim stay sharded."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist
from conftest import make_mesh
from tfdist import distributions as D
from tfdist.tensor import DTensor, Replicate, Shard, distribute_tensor


def layout_specs(t):
    """Results from tfdist DTensor parameters are tfdist DTensors (torch: DTensor in, DTensor out)."""
    assert isinstance(t, DTensor), type(t)
    return dtensor.fetch_layout(t.to_tf()).sharding_specs


def gather_to_numpy(t):
    assert isinstance(t, DTensor), type(t)
    return t.numpy()


def test_log_prob_and_sample_stay_sharded():
    mesh = make_mesh((2, 4))
    loc_np = np.arange(8, dtype=np.float32)
    loc = distribute_tensor(loc_np, mesh, [Shard(0), tfdist.tensor.Replicate()])
    scale = distribute_tensor(np.full(8, 2.0, np.float32), mesh, [Shard(0), tfdist.tensor.Replicate()])
    dist = D.Normal(loc, scale)
    x = distribute_tensor(np.zeros(8, np.float32), mesh, [Shard(0), tfdist.tensor.Replicate()])
    lp = dist.log_prob(x)
    assert layout_specs(lp) == ["dp"]
    np.testing.assert_allclose(gather_to_numpy(lp), st.norm(loc_np, 2.0).logpdf(0.0), rtol=1e-5)
    tf.random.set_seed(3)
    samples = dist.sample((4000,))
    assert layout_specs(samples) == ["unsharded", "dp"]
    values = gather_to_numpy(samples)
    assert values.shape == (4000, 8)
    np.testing.assert_allclose(values.mean(0), loc_np, atol=4 * 2.0 / np.sqrt(4000))
    np.testing.assert_allclose(values.std(0), 2.0, rtol=0.06)
    # the draws do not depend on how the parameters are sharded
    one = tfdist.DeviceMesh("cpu", [2])
    tf.random.set_seed(3)
    ref = D.Normal(distribute_tensor(loc_np, one, [Shard(0)]), distribute_tensor(np.full(8, 2.0, np.float32), one,
                                                                                 [Shard(0)])).sample((4000,))
    np.testing.assert_allclose(gather_to_numpy(ref), values, rtol=1e-6, atol=1e-6)


def test_gamma_samples_sharded_and_von_mises_without_icdf_is_a_clear_error():
    mesh = make_mesh((8,))
    conc = distribute_tensor(np.full(8, 2.0, np.float32), mesh, [Shard(0)])
    tf.random.set_seed(5)
    draws = D.Gamma(conc, conc).sample((3000,))
    assert layout_specs(draws) == ["unsharded", "x"]
    assert st.kstest(gather_to_numpy(draws)[:, 3], st.gamma(2.0, scale=0.5).cdf).pvalue > 1e-4
    with pytest.raises(NotImplementedError, match="needs its icdf"):  # no icdf in TFP, not on the integers
        D.VonMises(conc, conc).sample((3,))
    for family in (D.Beta, D.StudentT):  # TFP's quantile makes a plain tensor: a clear error, not TF's text
        with pytest.raises(NotImplementedError, match=rf"sampling {family.__name__} with DTensor parameters: "
                                                      "TFP's quantile for it makes a plain tensor"):
            (family(conc, conc) if family is D.Beta else family(conc)).sample((3,))


def test_dtensor_parameters_mix_with_numbers_and_plain_tensors():
    mesh = make_mesh((8,))
    x = np.linspace(-1, 1, 8).astype(np.float32)
    loc = distribute_tensor(np.zeros(8, np.float32), mesh, [Shard(0)])
    dist = D.Normal(loc, 1.0)  # torch broadcasts the number; TF DTensor alone would refuse it
    lp = dist.log_prob(x)  # a plain array beside DTensor parameters
    assert layout_specs(lp) == ["x"]
    np.testing.assert_allclose(lp.numpy(), st.norm.logpdf(x), rtol=1e-5)
    assert isinstance(dist.mean, DTensor) and isinstance(dist.entropy(), DTensor)
    binomial = D.Binomial(total_count=4, probs=distribute_tensor(np.full(8, 0.3, np.float32), mesh, [Shard(0)]))
    np.testing.assert_allclose(binomial.entropy().numpy(), st.binom(4, 0.3).entropy(), rtol=1e-5)


@pytest.mark.parametrize("method", ["sample", "rsample", "sample_n"])
def test_sampling_inside_tf_function_draws_fresh_sharded_values_the_same_on_any_mesh(method):
    """Inside a tf.function a draw takes its seed from a counter on the mesh (as Keras' SeedGenerator):
    every call draws new values, the same sequence on any mesh after tfdist.manual_seed, sharded like
    the parameters."""
    draw = {"sample": lambda d: d.sample((2,)), "rsample": lambda d: d.rsample((2,)),
            "sample_n": lambda d: d.sample_n(2)}[method]
    seen = {}
    for shape in ((8,), (2, 4)):
        mesh = make_mesh(shape)
        loc = distribute_tensor(np.arange(16, dtype=np.float32), mesh, [Shard(0)] + [Replicate()] * (len(shape) - 1))
        fn = tf.function(lambda l: draw(D.Normal(l, 1.0)))
        tfdist.manual_seed(4)
        first, second = fn(loc), fn(loc)
        assert dtensor.fetch_layout(first).sharding_specs[1] == mesh.mesh_dim_names[0]  # sharded like loc
        seen[shape] = [DTensor.from_tf(t).numpy() for t in (first, second)]
        assert not np.allclose(seen[shape][0], seen[shape][1])  # a fresh draw per call
        tfdist.manual_seed(4)
        np.testing.assert_allclose(DTensor.from_tf(fn(loc)).numpy(), seen[shape][0], rtol=1e-6)  # reseeded
    for a, b in zip(seen[(8,)], seen[(2, 4)]):  # float32 ndtri may differ in the last ulp by shard size
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    z = (seen[(8,)][0] - np.arange(16)).ravel()
    assert abs(z.mean()) < 0.6 and 0.5 < z.std() < 1.6
    lp = tf.function(lambda l: D.Normal(l, 1.0).log_prob(l))(loc)
    lp = lp if isinstance(lp, DTensor) else DTensor.from_tf(lp)  # traced: TF's layout comes back
    np.testing.assert_allclose(lp.numpy(), st.norm(0, 1).logpdf(0.0), rtol=1e-6)


def test_discrete_draws_inside_tf_function_equal_on_any_mesh():
    """Poisson (integer quantile search in a while loop) and Categorical, traced, on two meshes."""
    seen = {}
    for shape in ((8,), (2, 4)):
        mesh = make_mesh(shape)
        placements = [Shard(0)] + [Replicate()] * (len(shape) - 1)
        rate = distribute_tensor(np.linspace(0.5, 9, 8).astype(np.float32), mesh, placements)
        logits = distribute_tensor(np.tile([[1.0, 0.0, -1.0]], (8, 1)).astype(np.float32), mesh, placements)
        tfdist.manual_seed(9)
        out = tf.function(lambda r, g: (D.Poisson(r).sample((500,)), D.Categorical(logits=g).sample((500,))))(
            rate, logits)
        seen[shape] = [DTensor.from_tf(t).numpy() for t in out]
    for a, b in zip(seen[(8,)], seen[(2, 4)]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(seen[(8,)][0].mean(0), np.linspace(0.5, 9, 8), rtol=0.2)
