"""register_sharding: tell tfdist how an op may be sharded.

Like torch, a strategy function receives the op's arguments with every
DTensor replaced by its ``DTensorSpec`` (``.shape``, ``.ndim``,
``.placements``, ``.mesh``) and returns the acceptable shardings for *one*
mesh dim, each as ``(output_placement(s), input_placements)`` where
``input_placements`` has one entry per positional argument (``None`` for
non-tensors).  tfdist picks, per mesh dim, the acceptable sharding that is
cheapest to reach from the inputs' current placements, redistributes, runs
the op on the physical TF DTensors and wraps the result.  A registration
overrides tfdist's built-in rule for that op, and adds DTensor support for
any TF API that had none.  A strategy may give a ``Partial`` output (torch's
row-times-column split of a contraction): that one runs the op on each
device's local shards with ``local_map``, since TF DTensor's global op would
reduce inside.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor import _dispatch
from tfdist.tensor._api import DTensor
from tfdist.tensor._layout import DTensorSpec
from tfdist.tensor._redistribute import redistribute_physical
from tfdist.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["register_sharding"]

# cost of moving one mesh dim from a placement to another (torch's ordering)
_INF = float("inf")


def _cost(src: Placement, dst: Placement) -> float:
    if src == dst:
        return 0.0
    if isinstance(dst, Partial):
        return _INF
    if isinstance(src, Partial):
        return 3.0 if dst.is_replicate() else 2.0  # all-reduce / reduce-scatter
    if isinstance(src, Shard):
        return 2.0 if dst.is_replicate() else 1.0  # all-gather / all-to-all
    return 0.0  # Replicate -> Shard: local slice


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def _combo_cost(combo, specs: list[DTensorSpec | None]) -> float:
    """Total cost of giving mesh dim m the strategy ``combo[m]``; inf if not expressible."""
    total = 0.0
    for i, spec in enumerate(specs):
        if spec is None:
            continue
        dims = set()
        for m, (_, ins) in enumerate(combo):
            p = ins[i] or Replicate()
            if isinstance(p, Shard):
                # TF layouts shard a dim once; uneven shards need padding-aware ops
                if p.dim in dims or spec.shape[p.dim] % spec.root_shape[m]:
                    return _INF
                dims.add(p.dim)
            total += _cost(spec.root_placements[m], p)
    return total


def _choose(strategies, specs: list[DTensorSpec | None], root_ndim: int):
    """The cheapest assignment of one acceptable strategy to each root mesh dim."""
    best, best_cost = None, _INF
    for combo in itertools.product(strategies, repeat=root_ndim):
        cost = _combo_cost(combo, specs)
        if cost < best_cost:
            best, best_cost = combo, cost
    if best is None:
        raise ValueError(
            "register_sharding: no combination of the acceptable shardings fits this "
            "mesh; include an all-Replicate strategy."
        )
    return list(best)


def _run_custom(api: Callable, strategy_fn: Callable, args: tuple, kwargs: dict):
    if any(isinstance(v, DTensor) for v in kwargs.values()):
        raise ValueError(
            f"{getattr(api, '__name__', api)} with a registered sharding takes DTensors "
            "as positional arguments only."
        )
    dts = [a for a in args if isinstance(a, DTensor)]
    for i, a in enumerate(args):
        if not isinstance(a, DTensor) and isinstance(a, tf.Tensor) and a.shape.rank:
            raise TypeError(f"argument {i} is a plain non-scalar tensor; distribute it first.")
    mesh = _dispatch._common_mesh(dts)
    root = mesh.root_mesh
    specs = [_dispatch._root_spec(a._spec) if isinstance(a, DTensor) else None for a in args]
    spec_args = [s if s is not None else a for s, a in zip(specs, args)]
    strategies = []
    for out, ins in strategy_fn(*spec_args, **kwargs):
        ins = list(ins)
        if len(ins) != len(args):
            raise ValueError(
                f"a strategy gave {len(ins)} input placements for {len(args)} arguments: "
                f"{(out, ins)!r}"
            )
        strategies.append((out, ins))
    chosen = _choose(strategies, specs, root.ndim)
    if any(isinstance(p, Partial) for out, _ in chosen for p in _as_tuple(out)):
        return _run_locally(api, chosen, args, kwargs, specs, mesh)
    physical = []
    for i, a in enumerate(args):
        if specs[i] is None:
            physical.append(a)
            continue
        target = tuple((ins[i] or Replicate()) for _, ins in chosen)
        dst = DTensorSpec(root, target, specs[i].shape)
        physical.append(redistribute_physical(a._physical, specs[i], dst))
    result = api(*physical, **kwargs)
    results = [result] if isinstance(result, tf.Tensor) else list(result)
    wrapped = []
    for j, y in enumerate(results):
        out_root = tuple(_as_tuple(out)[j] or Replicate() for out, _ in chosen)
        spec = DTensorSpec(root, out_root, tuple(y.shape.as_list()))
        wrapped.append(DTensor._wrap(dtensor.relayout(y, spec.tf_layout), spec))
    return wrapped[0] if isinstance(result, tf.Tensor) else type(result)(wrapped)


def _run_locally(api: Callable, chosen, args: tuple, kwargs: dict, specs, mesh):
    """A strategy with a Partial output: TF DTensor would reduce inside the global op, so the op runs on
    each device's local shards instead (``local_map``), which leaves each device its partial result."""
    from tfdist.tensor.experimental._local_map import local_map  # lazy: only Partial strategies need it

    if mesh.root_mesh != mesh:
        raise NotImplementedError(
            f"{getattr(api, '__name__', api)}: a registered strategy with a Partial output needs DTensors on a "
            f"root mesh (its placements name every mesh dim); these live on the sub-mesh {mesh!r}.")
    in_placements = [None if spec is None else tuple(ins[i] or Replicate() for _, ins in chosen)
                     for i, spec in enumerate(specs)]
    n_out = len(_as_tuple(chosen[0][0]))
    out_placements = [tuple(_as_tuple(out)[j] or Replicate() for out, _ in chosen) for j in range(n_out)]
    fn = local_map(lambda *a: api(*a, **kwargs), out_placements[0] if n_out == 1 else out_placements,
                   in_placements, mesh, redistribute_inputs=True)
    return fn(*args)


def register_sharding(op: Callable) -> Callable[[Callable], Callable]:
    """Registers the acceptable shardings of TF API ``op`` for DTensor arguments.

    Example (a cumulative sum may be sharded on any dim but the one it scans)::

        @register_sharding(tf.math.cumsum)
        def cumsum_strategy(x, axis=0, exclusive=False, reverse=False, name=None):
            scan = axis % x.ndim
            options = [(Replicate(), [Replicate(), None, None, None, None])]
            options += [(Shard(d), [Shard(d), None, None, None, None])
                        for d in range(x.ndim) if d != scan]
            return options

        y = tf.math.cumsum(x, axis=1)   # x: DTensor -> y: DTensor, no gather if x is Shard(0)
    """
    if not callable(op):
        raise TypeError(f"op must be a TF API function. Received: op={op!r}")

    def decorator(strategy_fn: Callable) -> Callable:
        _dispatch.CUSTOM_STRATEGIES[op] = lambda *a, **k: _run_custom(op, strategy_fn, a, k)
        if op not in _dispatch.DISPATCHED_APIS:
            _install(op)
        return strategy_fn

    return decorator


def _install(op: Callable) -> None:
    signature = inspect.signature(op)
    first = next(iter(signature.parameters))

    def handler(*args: Any, **kwargs: Any):
        return _dispatch.CUSTOM_STRATEGIES[op](*args, **kwargs)

    handler.__signature__ = signature  # TF checks the handler's signature against the API's
    try:
        tf.experimental.dispatch_for_api(op, {first: DTensor})(handler)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{getattr(op, '__name__', op)} does not support TF API dispatch, so tfdist "
            f"cannot route DTensors to it: {err}"
        ) from err
    _dispatch.DISPATCHED_APIS.add(op)
