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
from tfdist.tensor import DTensor, Shard, distribute_tensor


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
def test_sampling_inside_tf_function_is_a_clear_error_and_log_prob_works(method):
    """TF DTensor has no layout rule for random ops: a clear NotImplementedError naming the
    way out (sample eagerly), not TF's raw MLIR text; densities still trace; the process
    stays usable."""
    mesh = make_mesh((8,))
    loc = distribute_tensor(np.zeros(16, np.float32), mesh, [Shard(0)])
    draw = {"sample": lambda d: d.sample((2,)), "rsample": lambda d: d.rsample((2,)),
            "sample_n": lambda d: d.sample_n(2)}[method]
    with pytest.raises(NotImplementedError, match=r"inside a tf.function .* Sample eagerly"):
        tf.function(lambda l: draw(D.Normal(l, 1.0)))(loc)
    lp = tf.function(lambda l: D.Normal(l, 1.0).log_prob(l))(loc)
    lp = lp if isinstance(lp, DTensor) else DTensor.from_tf(lp)  # traced: TF's layout comes back
    np.testing.assert_allclose(lp.numpy(), st.norm(0, 1).logpdf(0.0), rtol=1e-6)
    samples = draw(D.Normal(loc, 1.0))  # eagerly: sharded like the parameters
    assert isinstance(samples, DTensor) and tuple(samples.shape) == (2, 16)
