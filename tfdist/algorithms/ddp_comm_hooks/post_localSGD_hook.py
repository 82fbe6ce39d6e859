"""``post_localSGD_hook`` (torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook).

For the first ``start_localSGD_iter`` backward passes every replica gets the
replicas' mean gradient (synchronous DDP); after that each replica keeps the
gradient averaged within its subgroup only (``post_local_gradient_allreduce``)
or its own gradient, so the replicas drift apart until
``PostLocalSGDOptimizer``'s averager averages the parameters.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist._runtime import get_world_size
from tfdist.algorithms.model_averaging.utils import _check_group
from tfdist.nn.parallel._grad_bucket import GradBucket
from tfdist.nn.parallel._replicas import Replicas, counter, replica_mean

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]


class PostLocalSGDState:
    """The hook's state: when local SGD starts, and the iteration count (on the replicas' mesh, so a
    traced step switches at the right iteration without being traced again).

    ``subgroup=None`` is torch's default, the replicas of one host: in tfdist
    the replicas of one client.  With one client that is every replica (the
    gradients stay averaged, as on one torch node); with one replica per
    client it is the replica alone.  tfdist has no process groups, so an
    explicit ``subgroup`` is refused.

    Example::

        state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
        model.register_comm_hook(state, post_localSGD_hook)
    """

    def __init__(self, process_group: object, subgroup: object, start_localSGD_iter: int,
                 post_local_gradient_allreduce: bool = True) -> None:
        _check_group(process_group)
        if subgroup is not None:
            raise ValueError("PostLocalSGDState: subgroup must be None (the replicas of one client) in tfdist, "
                             f"which has no process groups. Received: subgroup={subgroup!r}")
        if not isinstance(start_localSGD_iter, int) or start_localSGD_iter < 0:
            raise ValueError("PostLocalSGDState: start_localSGD_iter must be a non-negative int. "
                             f"Received: start_localSGD_iter={start_localSGD_iter!r}")
        self.process_group, self.subgroup = process_group, subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = bool(post_local_gradient_allreduce)
        self._counter = None

    @property
    def iter(self) -> int:
        """Backward passes counted so far (counting stops once local SGD has started, as torch)."""
        return 0 if self._counter is None else int(self._counter.numpy())

    def _check_replicas(self, replicas: Replicas) -> None:
        """Refuses a module whose replicas' client subgroups tfdist cannot form (at registration)."""
        clients = get_world_size()
        if self.post_local_gradient_allreduce and clients not in (1, replicas.count):
            raise NotImplementedError(
                f"PostLocalSGDState: averaging within each client's replicas ({replicas.count} replicas on "
                f"{clients} clients) needs the replicas grouped by client on a 2-D mesh; tfdist supports one "
                "client (every replica) or one replica per client. Or pass post_local_gradient_allreduce=False.")

    def _iteration(self, bucket: GradBucket) -> tf.Tensor:
        if self._counter is None:
            self._counter = counter(bucket.mesh)
        return self._counter.read_value()

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Counts one backward pass at its last bucket, until local SGD has started."""
        if bucket.is_last():
            now = self._iteration(bucket)
            self._counter.assign_add(tf.cast(now < self.start_localSGD_iter, tf.int64))


def post_localSGD_hook(state: PostLocalSGDState, bucket: GradBucket) -> tf.Tensor:
    """The replicas' mean gradient before ``state.start_localSGD_iter``; then each client's mean
    (``post_local_gradient_allreduce``) or each replica's own gradient.

    Example::

        model.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=10), post_localSGD_hook)
    """
    grads = bucket.buffer()
    warming = state._iteration(bucket) < state.start_localSGD_iter

    def averaged():
        return replica_mean(grads, bucket.mesh, bucket.dp)[1]

    def local():
        if state.post_local_gradient_allreduce and get_world_size() == 1:
            return averaged()  # one client: its subgroup is every replica
        return tf.identity(grads)

    out = tf.cond(warming, averaged, local)
    state.maybe_increase_iter(bucket)
    return out
