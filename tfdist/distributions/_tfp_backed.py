"""The base of distributions computed by TensorFlow Probability (imported lazily)."""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.distributions import constraints
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.utils import as_shape
from tfdist.tensor import _random
from tfdist.tensor._factory import _random_seed, traced_seed_start
from tfdist.tensor._layout import DTensorSpec, placements_from_tf_layout
from tfdist.tensor.placement_types import Shard

__all__ = ["_TFPBacked", "integer_quantile", "tfd"]


@functools.lru_cache(maxsize=None)
def tfd():
    import tensorflow_probability as tfp

    return tfp.distributions


def _on_integers(support) -> bool:
    return isinstance(support, (constraints._IntegerGreaterThan, constraints._IntegerInterval,
                                constraints._Boolean)) or support is constraints.nonnegative_integer


def integer_quantile(cdf, u: tf.Tensor, max_steps: int = 64) -> tf.Tensor:
    """The smallest integer ``k >= 0`` with ``cdf(k) >= u``, elementwise, as ``u``'s dtype.

    An upper bound is found by doubling from 1, then the gap is halved: at most ``max_steps`` cdf
    evaluations each (2**63 > any count), elementwise ops only, so a sharded ``u`` stays sharded.
    """
    one = tf.ones_like(u)

    def short(hi):
        return tf.logical_and(tf.cast(cdf(hi), u.dtype) < u, hi < 2.0 ** (max_steps - 1))

    hi = tf.while_loop(lambda hi: tf.reduce_any(short(hi)), lambda hi: [tf.where(short(hi), 2 * hi, hi)],
                       [one], maximum_iterations=max_steps)[0]

    def halve(lo, hi):
        mid = tf.floor((lo + hi) / 2)
        ok = tf.cast(cdf(mid), u.dtype) >= u
        return [tf.where(ok, lo, mid), tf.where(ok, mid, hi)]

    lo, hi = tf.while_loop(lambda lo, hi: tf.reduce_any(hi - lo > 1), halve, [-one, hi],
                           maximum_iterations=max_steps)
    return hi


class _TFPBacked(Distribution):
    """Delegates computation to ``self._tfp()``; subclasses map the parameters."""

    _params: tuple[str, ...] = ()
    _param_event_ndims: dict[str, int] = {}

    def _tfp(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def rsample(self, sample_shape=()):
        if not self.has_rsample:
            raise NotImplementedError
        return self._draw(sample_shape)

    def _sample(self, sample_shape):
        return tf.stop_gradient(self._draw(sample_shape))

    def _draw(self, sample_shape):
        """TFP's sampler, or with DTensor parameters tfdist's sharding-invariant one (eager or traced)."""
        layout = self._dtensor_layout()
        if layout is not None:
            return self._sample_sharded(sample_shape, layout)
        if not tf.executing_eagerly() and getattr(self, "_dtensor_mesh", None) is not None:
            return self._sample_traced(sample_shape)
        return self._tfp().sample(as_shape(sample_shape))

    def _sample_traced(self, sample_shape):
        """Inside a ``tf.function``: uniforms from the mesh's seed counter (``_random.next_seed``) as a
        pure function of (seed, global index), through :meth:`_from_uniform`; TF DTensor's layout
        propagation shards them like the parameters."""
        shape = as_shape(sample_shape).concatenate(self.batch_shape).concatenate(self.event_shape)
        mesh = self._dtensor_mesh.to_tf()
        seed = _random.next_seed(mesh, traced_seed_start)
        return self._from_uniform(_random.traced_unit(tuple(shape.as_list()), seed, mesh, self._dtype))

    # -- DTensor parameters ---------------------------------------------------------
    def _dtensor_layout(self):
        """The layout of a parameter that is a TF DTensor (eager), else None."""
        if not tf.executing_eagerly():
            return None
        for name in self._params:
            value = getattr(self, name)
            if isinstance(value, tf.Tensor) and dtensor.is_dtensor(value):
                return dtensor.fetch_layout(value)
        return None

    def _sample_sharded(self, sample_shape, layout):
        """Samples that stay sharded like the parameters: per-shard uniforms through the inverse CDF.

        TF DTensor has no layout rule for random ops, so tfdist draws the
        uniforms with its sharding-invariant per-shard generator
        (tfdist.tensor._random) and maps them with :meth:`_from_uniform`.
        """
        sample_shape = as_shape(sample_shape)
        shape = sample_shape.concatenate(self.batch_shape).concatenate(self.event_shape)
        placements = self._draw_placements(placements_from_tf_layout(layout), len(sample_shape))
        spec = DTensorSpec(DeviceMesh.from_tf(layout.mesh), placements, tuple(shape.as_list()))
        bits = _random.uniform_bits(spec, _random_seed())
        return self._from_uniform(_random._unit(bits, self._dtype, open_low=True))

    def _draw_placements(self, param_placements, sample_ndim: int) -> tuple:
        """The draw's placements (sample + batch + event dims) from a parameter's, whose dims are the
        draw's last ones (batch + event, as they broadcast)."""
        lead = sample_ndim + len(self.batch_shape) + len(self.event_shape) - self._param_rank
        return tuple(Shard(p.dim + lead) if isinstance(p, Shard) else p for p in param_placements)

    @property
    def _param_rank(self) -> int:
        return getattr(self, self._params[0]).shape.rank

    def _from_uniform(self, u: tf.Tensor) -> tf.Tensor:
        """One draw per element of ``u`` (uniform in (0, 1)): the inverse CDF, or for a family on the
        integers whose TFP class has none, the smallest k with cdf(k) >= u (:func:`integer_quantile`)."""
        try:
            return self.icdf(u)
        except NotImplementedError as err:
            if not _on_integers(self.support):
                raise NotImplementedError(
                    f"sampling {type(self).__name__} with DTensor parameters needs its icdf, which TFP "
                    "does not provide; TF DTensor has no layout rule for random ops."
                ) from err
        except tf.errors.UnimplementedError as err:
            if "got a regular tensor" not in str(err):
                raise
            raise NotImplementedError(
                f"sampling {type(self).__name__} with DTensor parameters: TFP's quantile for it makes a plain "
                "tensor beside the DTensor parameters, which TF DTensor refuses ("
                f"{str(err).splitlines()[0][:120]}...). Sample with plain parameters, or distribute the draws "
                "afterwards with tfdist.tensor.distribute_tensor."
            ) from None
        return integer_quantile(lambda k: self._tfp().cdf(tf.cast(k, self._dtype)), u)  # k: candidates, unchecked

    def log_prob(self, value):
        self._validate_sample(value)
        return self._tfp().log_prob(tf.cast(value, self._dtype))

    def cdf(self, value):
        self._validate_sample(value)
        return self._tfp().cdf(tf.cast(value, self._dtype))

    def icdf(self, value):
        return self._tfp().quantile(tf.cast(value, self._dtype))

    def entropy(self):
        return self._tfp().entropy()

    @property
    def mean(self):
        return self._tfp().mean()

    @property
    def mode(self):
        return self._tfp().mode()

    @property
    def variance(self):
        return self._tfp().variance()

    @property
    def _dtype(self):
        return getattr(self, self._params[0]).dtype

    def expand(self, batch_shape, _instance=None):
        """The same distribution with its parameters broadcast to ``batch_shape``."""
        batch_shape = as_shape(batch_shape)
        kwargs = {}
        for name in self._params:
            value = getattr(self, name)
            event = value.shape[value.shape.rank - self._param_event_ndims.get(name, 0):]
            kwargs[name] = tf.broadcast_to(value, batch_shape.concatenate(event))
        return type(self)(**kwargs, **self._extra_kwargs())

    def _extra_kwargs(self) -> dict:
        return {}
