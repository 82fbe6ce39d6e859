"""``DistributedDataParallel`` (torch.nn.parallel.DistributedDataParallel) for Keras models.

Plain synchronous data parallelism on TF needs nothing from tfdist (Keras'
``DataParallel``: replicated weights, TF all-reduces the gradients).  This
class exists for what DDP adds on top: communication hooks -- above all
``post_localSGD_hook``, with which replicas stop averaging their gradients
and drift apart between ``PostLocalSGDOptimizer``'s periodic averages.  So
each parameter gets ``R`` replicas (a stacked variable ``[R, *shape]``, row
``r`` on data-parallel device ``r``), the model runs per replica on its rows
of the batch, and each replica's gradient goes through the hook: the default
one averages them (one all-reduce per parameter: DDP's bytes), so the
replicas stay equal; a local-SGD hook leaves them apart.

``model.trainable_variables`` are the stacked replicas (what the optimizer
updates); the module's own variables hold the last average (what
``get_weights``, ``save`` and a checkpoint of the module see), written by
``tfdist.algorithms.model_averaging``.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _registry
from tfdist.device_mesh import DeviceMesh, default_data_parallel_mesh
from tfdist.nn.parallel._grad_bucket import GradBucket
from tfdist.nn.parallel._replicas import Replicas, replica_mean, replica_sum
from tfdist.tensor._api import client_0_value
from tfdist.tensor._modules import module_backend
from tfdist.tensor._per_device import per_device_call
from tfdist.tensor.parallel.style import as_tf, on_mesh

__all__ = ["DistributedDataParallel"]

_DDP_CLASSES: dict[type, type] = {}


def allreduce_mean(state: Any, bucket: GradBucket) -> tf.Tensor:
    """DDP's own reduction: every replica gets the mean of the replicas' gradients."""
    return replica_mean(bucket.buffer(), bucket.mesh, bucket.dp)[1]


class _DDPMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _DDPModule)


class _DDPModule:
    """What ``DistributedDataParallel`` adds to the module's class."""

    @property
    def _ddp(self) -> "_DDPState":
        return _registry.module(self).ddp

    @property
    def module(self) -> Any:
        """The wrapped module: the module itself (its class now also DDP's)."""
        return self

    @property
    def trainable_weights(self) -> list[Any]:
        """The stacked replicas ``[R, *shape]`` of the module's trainable variables."""
        return list(self._ddp.replicas.stacked)

    @property
    def trainable_variables(self) -> list[Any]:
        return self.trainable_weights

    def register_comm_hook(self, state: object, hook: Callable[[Any, GradBucket], tf.Tensor]) -> None:
        """Each backward hands every parameter's per-replica gradients to ``hook(state, bucket)``
        (see ``tfdist.GradBucket``); what it returns is what each replica uses.  One hook per
        module, as torch.

        Example::

            state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
            model.register_comm_hook(state, post_localSGD_hook)
        """
        if not callable(hook):
            raise ValueError(f"register_comm_hook(hook) must be callable. Received: hook={hook!r}")
        if self._ddp.hook is not allreduce_mean:
            raise RuntimeError("register_comm_hook: a communication hook is already registered on this module "
                               "(torch allows one).")
        check = getattr(state, "_check_replicas", None)
        if check is not None:
            check(self._ddp.replicas)
        self._ddp.state, self._ddp.hook = state, hook


class _DDPState:
    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.state: object = None
        self.hook: Callable[[Any, GradBucket], tf.Tensor] = allreduce_mean


def _ddp_class(cls: type) -> type:
    if cls not in _DDP_CLASSES:  # the mixin first: its trainable_weights is what the optimizer sees
        _DDP_CLASSES[cls] = _registry.swapped_class(f"DistributedDataParallel{cls.__name__}", (_DDPModule, cls), cls)
    return _DDP_CLASSES[cls]


class DistributedDataParallel(metaclass=_DDPMeta):
    """Data parallelism with per-replica parameters and communication hooks; returns ``module``.

    Args follow torch.  ``device_mesh``: a 1-D mesh (default: the innermost
    ``with mesh:``, else every device), one replica per device.  ``dim``
    must be 0 (the batch dim).  ``process_group`` must be None (tfdist has
    meshes, not process groups).  ``device_ids``, ``output_device``,
    ``broadcast_buffers``, ``init_sync``, ``bucket_cap_mb``,
    ``find_unused_parameters``, ``check_reduction``,
    ``gradient_as_bucket_view``, ``static_graph`` and the rest have no TF
    meaning and are accepted.  The replicas start equal, made from client
    0's values of the module (torch broadcasts rank 0's module state).

    Example::

        model = DistributedDataParallel(model, device_mesh=mesh)
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)   # averaged over the replicas
        optimizer.apply(grads, model.trainable_variables)
    """

    def __new__(
        cls, module: Any, device_ids: Any = None, output_device: Any = None, dim: int = 0,
        broadcast_buffers: bool = True, init_sync: bool = True, process_group: Any = None,
        bucket_cap_mb: Any = None, find_unused_parameters: bool = False, check_reduction: bool = False,
        gradient_as_bucket_view: bool = False, static_graph: bool = False,
        delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None, device_mesh: DeviceMesh | None = None, skip_all_reduce_unused_params: bool = False,
    ) -> Any:
        modules = module_backend(module, "DistributedDataParallel")
        name = modules.layer_name(module)
        if dim != 0:
            raise ValueError(f"DistributedDataParallel({name!r}): dim must be 0 (the batch dim). Received: dim={dim!r}")
        if process_group is not None:
            raise ValueError(f"DistributedDataParallel({name!r}): process_group must be None in tfdist; pass "
                             f"device_mesh (a 1-D DeviceMesh). Received: process_group={process_group!r}")
        if mixed_precision is not None:
            raise ValueError(f"DistributedDataParallel({name!r}): mixed_precision is not supported; use a Keras "
                             f"dtype policy. Received: mixed_precision={mixed_precision!r}")
        mesh = device_mesh if device_mesh is not None else default_data_parallel_mesh()
        if mesh.ndim != 1:
            raise ValueError(f"DistributedDataParallel({name!r}): device_mesh must be 1-D (one replica per device). "
                             f"Received: a mesh of shape {tuple(mesh.shape)}")
        if isinstance(module, _DDPModule) or _registry.module_if_any(module) is not None and (
                _registry.module(module).fsdp is not None):
            raise ValueError(f"DistributedDataParallel({name!r}): the module is already distributed (DDP or FSDP).")
        if not modules.is_built(module):
            raise ValueError(f"DistributedDataParallel({name!r}): the module is not built; call it once on a batch "
                             "first (model(x[:1])).")
        replicas = _make_replicas(modules, module, mesh)
        modules.attach_mesh(module, mesh, mesh.root_dims[0])  # Keras' fit splits the batch over dp
        _registry.module(module).ddp = _DDPState(replicas)
        modules.replace_call(module, _replica_call(modules, module))
        module.__class__ = _ddp_class(type(module))
        return module


def _make_replicas(modules, module: Any, mesh: DeviceMesh) -> Replicas:
    """R copies of each trainable variable, stacked on dp; the variables themselves replicated."""
    root = mesh.root_mesh
    tf_mesh, dp = root.to_tf(), root.axis_names[mesh.root_dims[0]]
    count = tf_mesh.dim_size(dp)
    originals = [v for v in modules.variables(module) if modules.is_trainable(v)]
    stacked = []
    for variable in originals:
        if modules.is_placed(variable):
            raise ValueError(f"DistributedDataParallel: {variable.path} is already on a mesh; DDP replicates a "
                             "module whose variables are not distributed.")
        value = tf.convert_to_tensor(client_0_value(variable.numpy(), mesh))  # torch broadcasts rank 0's
        layout = dtensor.Layout([dp] + [dtensor.UNSHARDED] * len(value.shape), tf_mesh)
        rows = tf.broadcast_to(tf.expand_dims(value, 0), [count] + list(value.shape))
        stacked.append(modules.new_variable(rows, layout, f"{variable.name}_replicas", trainable=True))
    for variable in modules.variables(module):
        if not modules.is_placed(variable):
            modules.place_variable(variable, dtensor.Layout.replicated(tf_mesh, len(variable.shape)))
    replicas = Replicas(originals, stacked, tf_mesh, dp)
    for original, rep in zip(originals, stacked):
        _registry.variable(rep).replicas_of = (original, replicas)
    return replicas


def _replica_call(modules, module: Any) -> Callable:
    """The module's call run per replica on its rows; the gradients go through the comm hook."""

    def call(original, inputs, *args, **kwargs):
        x = tf.nest.map_structure(as_tf, inputs)  # a tensor, or a nest of them (keras-hub's dict inputs)
        leaves = tf.nest.flatten(x)
        if not leaves or any(modules.is_symbolic(t) or not isinstance(t, tf.Tensor) for t in leaves):
            return original(inputs, *args, **kwargs)
        own = _registry.module(module).ddp
        reps = own.replicas
        for t in leaves:
            if t.shape.rank in (None, 0) or (t.shape[0] is not None and t.shape[0] % reps.count):
                raise ValueError(f"DistributedDataParallel: the batch ({t.shape[0] if t.shape.rank else t.shape}) "
                                 f"must split evenly over the {reps.count} replicas.")
        x = tf.nest.map_structure(lambda t: on_mesh(t, reps.mesh), x)

        def fn(x_i, weights):
            with modules.read_as([(v, tf.cast(w, v.dtype)) for v, w in zip(reps.originals, weights)]):
                return original(x_i, *args, **kwargs)

        def through_hook(grads, dy, dx):
            last = max((i for i, g in enumerate(grads) if g is not None), default=-1)
            out = []
            for i, (g, rep) in enumerate(zip(grads, reps.stacked)):
                if g is None:
                    out.append(None)
                    continue
                layout = reps.stacked_layout(g.shape.rank)
                if own.hook is allreduce_mean:  # the mean of R x each share is their sum: no scaling pass
                    out.append(replica_sum(dtensor.relayout(g, layout), reps.mesh, reps.dp))
                    continue
                # the loss is a mean over the global batch: replica r's gradient of the mean over
                # its own rows (torch's per-rank gradient) is R times its share
                own_grad = dtensor.relayout(g * tf.cast(reps.count, g.dtype), layout)
                bucket = GradBucket(i, own_grad, rep, i == last, reps.mesh, reps.dp)
                result = tf.convert_to_tensor(own.hook(own.state, bucket))
                if result.shape != own_grad.shape:
                    raise ValueError(f"DistributedDataParallel: the comm hook must return the bucket's shape "
                                     f"{own_grad.shape}. Received: {result.shape}")
                out.append(dtensor.relayout(tf.cast(result, g.dtype), layout))
            return out

        values = [modules.stored_value(rep) for rep in reps.stacked]
        return per_device_call(fn, x, values, mesh=reps.mesh, dp=reps.dp, stack=lambda x, ins: ins,
                               unstack_grads=through_hook)

    return call
