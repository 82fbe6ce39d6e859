"""local_map: run a function on each device's local shards, in eager and tf.function.

TF DTensor only runs *global* programs, and ``dtensor.unpack``/``pack`` are
eager-only, so tfdist builds a *stacked local view* instead: every mesh dim
on which an input is sharded (or Partial) becomes a leading "device" axis
of size ``mesh.shape[m]``, sharded on ``m`` (a dim of ``n`` rows sharded on
``k`` devices is reshaped to ``(k, n/k)`` -- a local reshape).  The user's
function is vectorised over those axes with ``tf.vectorized_map`` (one map
per mesh dim, nested), so each device applies it to exactly its own shard;
inputs replicated on a mesh dim are captured, not copied.  Outputs are put
back by the inverse reshape.  Measured: no collective for the views (see
tests/test_local_map.py).  Uneven shards and dims sharded over several mesh
dims (inputs or outputs) have no equal-shaped stacked view: eagerly, the
function then runs once per device on ``local_tensors()`` and the results go
back through ``from_local`` (``_per_device``), an exact fallback off the hot path.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._api import DTensor
from tfdist.tensor._layout import DTensorSpec, normalize_placements, to_root_placements
from tfdist.tensor._traced_call import TracedCall
from tfdist.tensor._xla_local import LocalInput, NotCompilable, PerDeviceProgram, xla_platform
from tfdist.tensor.placement_types import Placement, Shard

__all__ = ["local_map", "compiled_per_device"]

Placements = Sequence[Placement]


def _layout(root: DeviceMesh, axes: Sequence[int | None]) -> dtensor.Layout:
    """Layout of a physical tensor whose dim ``i`` is sharded on root mesh dim ``axes[i]``."""
    names = root.axis_names
    return dtensor.Layout([dtensor.UNSHARDED if a is None else names[a] for a in axes], root.to_tf())


def _to_stacked(x: DTensor, device_dims: Sequence[int]) -> tuple[tf.Tensor, list[int]]:
    """Physical -> (stacked view, mesh dims that have a leading axis, in mesh order)."""
    spec = x._spec
    root = spec.mesh.root_mesh
    if spec.multi_dims:
        raise ValueError(
            "local_map needs each tensor dim sharded over at most one mesh dim. Received a "
            f"DTensor with placements {spec.placements}; redistribute it first, e.g. to "
            "keep only the outermost Shard of that dim."
        )
    if spec.uneven_dims:
        raise ValueError(
            "local_map needs evenly divisible shards: a vectorised per-device call "
            f"needs equal local shapes. Received a DTensor of shape {spec.shape} with "
            f"placements {spec.placements}; redistribute the uneven dims first."
        )
    t = x._physical
    # leading axes already present: the Partial axes
    axes: list[int | None] = list(spec.partial_mesh_dims) + [
        spec.shard_mesh_dims.get(d) for d in range(len(spec.shape))
    ]
    lead = list(spec.partial_mesh_dims)
    for m, p in enumerate(spec.root_placements):
        if not isinstance(p, Shard):
            continue
        k = root.shape[m]
        pos = axes.index(m)
        shape = t.shape.as_list()
        t = tf.reshape(t, shape[:pos] + [k, shape[pos] // k] + shape[pos + 1:])
        axes = axes[:pos] + [m, None] + axes[pos + 1:]
        t = dtensor.relayout(t, _layout(root, axes))
        perm = [pos] + [i for i in range(len(axes)) if i != pos]
        t = tf.transpose(t, perm)
        axes = [axes[i] for i in perm]
        t = dtensor.relayout(t, _layout(root, axes))
        lead.insert(0, m)  # the new device axis now stands first
    # order the leading axes by mesh dim
    n_lead = len(lead)
    order = sorted(range(n_lead), key=lambda i: lead[i])
    perm = order + list(range(n_lead, len(axes)))
    if perm != list(range(len(axes))):
        t = tf.transpose(t, perm)
        axes = [axes[i] for i in perm]
        t = dtensor.relayout(t, _layout(root, axes))
    return t, sorted(lead)


def _nested_map(fn: Callable, dims: list[int], args: list, arg_dims: list[list[int] | None]):
    """Vectorises ``fn`` over one leading axis per mesh dim in ``dims``."""
    if not dims:
        return fn(*args)
    m, rest = dims[0], dims[1:]
    mapped = [i for i, d in enumerate(arg_dims) if d is not None and m in d]
    if not mapped:
        return _nested_map(fn, rest, args, arg_dims)

    def body(elems):
        inner = list(args)
        inner_dims = list(arg_dims)
        for i, e in zip(mapped, elems):
            inner[i] = e
            inner_dims[i] = [d for d in arg_dims[i] if d != m]
        return _nested_map(fn, rest, inner, inner_dims)

    return tf.vectorized_map(body, tuple(args[i] for i in mapped))


def _from_stacked(
    y: tf.Tensor, have: list[int], out: tuple[Placement, ...], mesh: DeviceMesh, root: DeviceMesh
) -> DTensor:
    """Stacked local results (leading axes for mesh dims ``have``) -> DTensor with ``out``."""
    root_out = to_root_placements(mesh, out)
    local_rank = y.shape.rank - len(have)
    lead = list(have)
    axes: list[int | None] = lead + [None] * local_rank
    y = dtensor.relayout(y, _layout(root, axes))
    # Replicate outputs: the devices along m must agree; keep the first one's.
    for m in [m for m in lead if root_out[m].is_replicate()]:
        pos = lead.index(m)
        y = tf.gather(y, 0, axis=pos)
        lead.pop(pos)
        axes.pop(pos)
        y = dtensor.relayout(y, _layout(root, axes))
    # Shard/Partial outputs computed identically along m: every device holds it.
    for m in range(root.ndim):
        if not root_out[m].is_replicate() and m not in lead:
            pos = sum(1 for d in lead if d < m)
            y = tf.expand_dims(y, pos)
            shape = y.shape.as_list()
            shape[pos] = root.shape[m]
            y = tf.broadcast_to(y, shape)
            lead.insert(pos, m)
            axes.insert(pos, None)
            y = dtensor.relayout(y, _layout(root, axes))
            axes[pos] = m
            y = dtensor.relayout(y, _layout(root, axes))
    # Merge each Shard(d) axis into local dim d.
    for m in [m for m in list(lead) if isinstance(root_out[m], Shard)]:
        d = root_out[m].dim
        if not 0 <= d < local_rank:
            raise ValueError(
                f"out_placements has Shard({d}) but the function returned a {local_rank}-D "
                "local tensor."
            )
        pos = lead.index(m)
        target = len(lead) - 1 + d  # index of local dim d once the axis is removed
        perm = [i for i in range(len(axes)) if i != pos]
        perm.insert(target, pos)
        y = tf.transpose(y, perm)
        axes = [axes[i] for i in perm]
        y = dtensor.relayout(y, _layout(root, axes))
        shape = y.shape.as_list()
        merged = shape[:target] + [shape[target] * shape[target + 1]] + shape[target + 2:]
        y = tf.reshape(y, merged)
        axes = axes[:target] + [m] + axes[target + 2:]
        y = dtensor.relayout(y, _layout(root, axes))
        lead.remove(m)
    # What is left in front are the Partial axes, in mesh order: tfdist's encoding.
    n_lead = len(lead)
    global_shape = tuple(y.shape.as_list()[n_lead:])
    spec = DTensorSpec(mesh, tuple(out), global_shape)
    return DTensor._wrap(dtensor.relayout(y, spec.tf_layout), spec)


def local_map(
    func: Callable | None = None,
    out_placements: Placements | Sequence[Placements | None] | None = None,
    in_placements: Sequence[Placements | None] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
    jit_compile: bool = False,
) -> Callable:
    """Wraps ``func`` (written for local shards) to take and return DTensors.

    Args:
        func: a function of local ``tf.Tensor``s (and other values).  None: returns a
            decorator taking ``func`` with the other arguments (torch's
            ``@local_map(out_placements=...)``).
        out_placements: placements of the output (one sequence), or one per
            output of a tuple/list result (``None`` for a non-tensor output).
        in_placements: per positional argument, the placements it must have
            (``None`` for non-DTensor arguments); default: as given.
        device_mesh: the mesh; default the inputs' mesh.
        redistribute_inputs: redistribute inputs whose placements differ
            from ``in_placements`` (else that is an error).
        jit_compile: (tfdist) compile ``func`` with XLA for each device: on CPU
            and GPU meshes it runs as one XLA program per device between the
            program's collectives, the way ``shard_map`` runs under ``jax.jit``
            (``tfdist.tensor._xla_local``); on TPU meshes TF DTensor compiles the
            whole program with XLA anyway.  ``func`` then takes only tensors it
            is given (no captured symbolic tensors or variables) and returns
            tensors of static shape.

    Returns:
        A function taking DTensors.  Called with no DTensor it just calls
        ``func``.  Works eagerly and inside ``tf.function``, under a
        ``GradientTape`` in both; ``func`` is vectorised over the devices with
        ``tf.vectorized_map``.  An eager call runs as one ``tf.function``,
        traced once per input signature (so ``func``'s Python side effects
        happen at tracing, as in any ``tf.function``).

    Example (a row-wise scaled softmax on local rows, no communication)::

        f = local_map(lambda t: tf.nn.softmax(t * 2.0), [Shard(0)], [[Shard(0)]])
        y = f(x)   # x: DTensor [Shard(0)] -> y: DTensor [Shard(0)]

        @local_map(out_placements=[Shard(0)], in_placements=[[Shard(0)]])
        def softmax(t):
            return tf.nn.softmax(t)
    """
    if func is None:  # the decorator form
        return functools.partial(local_map, out_placements=out_placements, in_placements=in_placements,
                                 device_mesh=device_mesh, redistribute_inputs=redistribute_inputs,
                                 jit_compile=jit_compile)
    if not callable(func):
        raise TypeError(f"func must be callable. Received: func={func!r}")
    if not isinstance(jit_compile, bool):
        raise TypeError(f"jit_compile must be True or False. Received: jit_compile={jit_compile!r}")
    programs: dict = {}  # input signature -> PerDeviceProgram (jit_compile=True)

    # tf.vectorized_map converts ``func`` with autograph itself; the plumbing
    # around it must not be converted.
    @functools.wraps(func)
    @tf.autograph.experimental.do_not_convert
    def wrapped(*args: Any, **kwargs: Any):
        dts = [a for a in args if isinstance(a, DTensor)]
        if not dts:
            return func(*args, **kwargs)
        if any(isinstance(v, DTensor) for v in kwargs.values()):
            raise ValueError("local_map takes DTensors as positional arguments only.")
        mesh = device_mesh or dts[0].device_mesh
        root = mesh.root_mesh
        if in_placements is not None and len(in_placements) != len(args):
            raise ValueError(
                f"in_placements has {len(in_placements)} entries but the function got "
                f"{len(args)} positional arguments. Received: in_placements={in_placements!r}"
            )
        prepared = []
        for i, a in enumerate(args):
            want = None if in_placements is None else in_placements[i]
            if not isinstance(a, DTensor):
                if want is not None:
                    raise ValueError(
                        f"argument {i} is not a DTensor but in_placements[{i}] is {want!r}."
                    )
                prepared.append(a)
                continue
            if a.device_mesh.root_mesh != root:
                raise ValueError(
                    f"argument {i} lives on {a.device_mesh!r}, not on {mesh!r}."
                )
            if want is not None:
                want = normalize_placements(want, mesh, a.ndim)
                if a.device_mesh != mesh or tuple(a.placements) != want:
                    if not redistribute_inputs:
                        raise ValueError(
                            f"argument {i} has placements {a.placements} but in_placements[{i}] "
                            f"is {want}; pass redistribute_inputs=True to redistribute it."
                        )
                    a = a.redistribute(mesh, want)
            prepared.append(a)

        if any(isinstance(a, DTensor) and (a._spec.uneven_dims or a._spec.multi_dims) for a in prepared) \
                or _nests_a_dim(out_placements):
            local_func = tf.function(func, jit_compile=True, autograph=False) if jit_compile else func
            return _per_device(local_func, prepared, kwargs, out_placements, mesh)
        platform = xla_platform(root.device_type) if jit_compile else None
        if platform is None:
            if tf.executing_eagerly():  # one program; its backward traced with it (_traced_call)
                return traced(mesh, *prepared, **kwargs)
            return vectorised(mesh, *prepared, **kwargs)
        _, values, arg_dims, have = _stacked_views(prepared)
        try:
            result = _compiled_call(func, kwargs, values, arg_dims, have, root, platform, programs)
        except NotCompilable as error:  # a plain ValueError: autograph re-raises only known types
            raise ValueError(str(error)) from None
        return _wrap_outputs(result, out_placements, have, mesh, root)

    @tf.autograph.experimental.do_not_convert
    def vectorised(mesh: DeviceMesh, *args: Any, **kwargs: Any):
        """``func`` vectorised over the stacked views of ``args``' shards."""
        device_dims, values, arg_dims, have = _stacked_views(args)
        result = _nested_map(lambda *xs: func(*xs, **kwargs), device_dims, values, arg_dims)
        return _wrap_outputs(result, out_placements, have, mesh, mesh.root_mesh)

    traced = TracedCall(vectorised)  # the eager vectorised call (traced at its first call)
    return wrapped


def _stacked_views(args: Sequence[Any]) -> tuple[list[int], list, list, list[int]]:
    """The stacked view of every DTensor in ``args`` (other values as they are): the mesh dims
    some input varies on, the values, each one's leading mesh dims (None: not a DTensor), and
    the mesh dims the outputs get a leading axis for."""
    device_dims = sorted({
        m for a in args if isinstance(a, DTensor)
        for m, p in enumerate(a._spec.root_placements) if not p.is_replicate()
    })
    values, arg_dims = [], []
    for a in args:
        if isinstance(a, DTensor):
            t, lead = _to_stacked(a, device_dims)
            values.append(t)
            arg_dims.append(lead)
        else:
            values.append(a)
            arg_dims.append(None)
    have = [m for m in device_dims if any(d is not None and m in d for d in arg_dims)]
    return device_dims, values, arg_dims, have


def compiled_per_device(func: Callable, args: Sequence[DTensor], out_placements: Placements,
                        mesh: DeviceMesh, programs: dict, with_gradient: bool = False) -> Any:
    """``func`` of the local shards of ``args`` as one XLA program per device; ``func`` returns a
    nest of tensors (a Keras model's outputs), each laid out ``out_placements``: the same nest of
    DTensors.  For callers that learn the outputs only by tracing; ``programs`` caches the
    compiled programs by input signature (so one ``func`` per ``programs``); ``with_gradient``
    compiles the gradient's program too before anything is emitted (``NotCompilable`` then
    leaves the caller's program untouched but for unused view ops).  ``args`` must be even
    DTensors with one mesh dim per tensor dim, on a CPU or GPU mesh (``xla_platform``)."""
    root = mesh.root_mesh
    platform = xla_platform(root.device_type)
    if platform is None:
        raise ValueError(f"no per-device XLA programs on a {root.device_type} mesh: TF DTensor compiles it whole")
    _, values, arg_dims, have = _stacked_views(args)
    result = _compiled_call(func, {}, values, arg_dims, have, root, platform, programs, with_gradient)
    flat = tf.nest.flatten(result)
    return tf.nest.pack_sequence_as(result, _wrap_outputs(flat, [tuple(out_placements)] * len(flat), have, mesh, root))


def _compiled_call(func: Callable, kwargs: dict, values: list, arg_dims: list, have: list[int],
                   root: DeviceMesh, platform: str, programs: dict, with_gradient: bool = False):
    """``func`` on the stacked views ``values`` as one XLA program per device (``PerDeviceProgram``),
    built once per input signature.  Plain tensors among the arguments enter replicated; other
    arguments (Python values) are fixed into the program."""
    tensors, specs, places = [], [], []
    for k, (v, dims) in enumerate(zip(values, arg_dims)):
        if dims is None and not isinstance(v, (tf.Tensor, tf.Variable)):
            continue
        if dims is None:  # a tf.Tensor given as is: the same on every device
            v = dtensor.copy_to_mesh(tf.convert_to_tensor(v), dtensor.Layout.replicated(root.to_tf(), v.shape.rank))
            dims = []
        shape = tuple(v.shape.as_list())
        tensors.append(v)
        places.append(k)
        specs.append(LocalInput(shape, v.dtype, _layout(root, list(dims) + [None] * (len(shape) - len(dims))),
                                tuple(dims)))
    try:
        key = (tuple(specs), tuple(sorted(kwargs.items())), tuple(
            (k, v) for k, v in enumerate(values) if k not in places))
        hash(key)
    except TypeError:
        key = None  # an unhashable fixed argument: a program per call
    program = programs.get(key) if key is not None else None
    if program is None:
        def local(*xs):
            args = list(values)
            for k, x in zip(places, xs):
                args[k] = x
            return func(*args, **kwargs)

        program = PerDeviceProgram(
            local, specs, lambda rank: _layout(root, list(have) + [None] * (rank - len(have))),
            have, [root.shape[m] for m in have], platform)
        if with_gradient:
            program.prepare_gradient()
        if key is not None:
            programs[key] = program
    return program(*tensors)


def _nests_a_dim(out_placements) -> bool:
    """Whether some output's placements shard one tensor dim over several mesh dims."""
    groups = [out_placements] if out_placements and all(isinstance(p, Placement) for p in out_placements) \
        else [g for g in (out_placements or []) if g is not None]
    for group in groups:
        dims = [p.dim for p in group if isinstance(p, Shard)]
        if len(dims) != len(set(dims)):
            return True
    return False


def _per_device(func: Callable, args: list, kwargs: dict, out_placements, mesh: DeviceMesh):
    """local_map for shards a vectorised call cannot take (uneven, or one dim over several mesh dims):
    ``func`` runs once per local device on that device's shard (eagerly: ``local_tensors``), and the
    results are put back with ``from_local``, the global shape summed from the local ones.  Exact, but
    one call per device: off the hot path by design, and refused inside ``tf.function``."""
    if not tf.executing_eagerly():
        raise ValueError(
            "local_map of uneven shards or of a dim sharded over several mesh dims runs per device, eagerly "
            "(the vectorised form needs equal local shapes and one mesh dim per tensor dim); inside a "
            "tf.function, redistribute those inputs first.")
    if len(mesh.local_device_ids()) != mesh.size() or mesh.root_mesh != mesh:
        raise NotImplementedError(
            "local_map's per-device form (uneven or multi-mesh-dim shards) needs a root mesh whose devices are "
            "all on this client, to add up the output's global shape; redistribute the inputs first.")
    # each device's shard, its gradient read with the input's own placements, as torch's local_map
    # reads ``to_local()``: the copies along a Replicate mesh dim hold one gradient, not a sum
    locals_ = [a.local_tensors(grad_placements=a.placements) if isinstance(a, DTensor) else None for a in args]
    results = [func(*[a if loc is None else loc[i] for a, loc in zip(args, locals_)], **kwargs)
               for i in range(len(mesh.local_device_ids()))]
    single = isinstance(results[0], tf.Tensor)
    per_output = [[r] if single else list(r) for r in results]
    n = len(per_output[0])
    specs = [out_placements] if single else list(out_placements or [None] * n)
    if len(specs) != n:
        raise ValueError(f"func returned {n} outputs; give out_placements one entry per output "
                         f"(placements or None). Received: out_placements={out_placements!r}")
    outs = []
    for j, placements in enumerate(specs):
        column = [r[j] for r in per_output]
        if placements is None or not isinstance(column[0], tf.Tensor):
            outs.append(column[0])
            continue
        placements = normalize_placements(placements, mesh, column[0].shape.rank)
        outs.append(DTensor.from_local(column, mesh, placements, shape=_summed_shape(column, placements, mesh)))
    return outs[0] if single else type(results[0])(outs)


def _summed_shape(column: list[tf.Tensor], placements, mesh: DeviceMesh) -> tuple[int, ...]:
    """The global shape whose shards (``placements``, in mesh order) are ``column``'s local tensors: along
    a sharded dim, the sum of the sizes of the devices that differ only on the mesh dims sharding it."""
    coords = [tuple(c) for c in mesh.root_mesh.local_coordinates()]
    index = {c: i for i, c in enumerate(coords)}
    first = coords[0]
    shape = list(column[0].shape.as_list())
    for d in range(len(shape)):
        dims = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
        if not dims:
            continue
        total = 0
        for c in coords:
            if all(c[m] == first[m] for m in range(len(c)) if m not in dims):
                total += column[index[c]].shape[d]
        shape[d] = total
    return tuple(shape)


def _wrap_outputs(result, out_placements, have, mesh, root):
    single = isinstance(result, tf.Tensor)
    outs = [result] if single else list(result)
    if single:
        specs = [out_placements]
    elif out_placements is not None and len(out_placements) == len(outs) and all(
        o is None or isinstance(o, (list, tuple)) for o in out_placements
    ):
        specs = list(out_placements)
    else:
        raise ValueError(
            f"func returned {len(outs)} outputs; give out_placements one entry per output "
            f"(placements or None). Received: out_placements={out_placements!r}"
        )
    wrapped = []
    for y, placements in zip(outs, specs):
        if placements is None or not isinstance(y, tf.Tensor):
            wrapped.append(y)
            continue
        placements = tuple(placements)
        if len(placements) != mesh.ndim:
            raise ValueError(
                f"out_placements {placements} has {len(placements)} entries but the mesh has "
                f"{mesh.ndim} dims."
            )
        wrapped.append(_from_stacked(y, list(have), placements, mesh, root))
    return wrapped[0] if single else type(result)(wrapped)
