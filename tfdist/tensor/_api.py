"""The DTensor type and the ways to make one: distribute_tensor, from_local, from_tf.

A tfdist ``DTensor`` is a ``tf.experimental.ExtensionType`` holding one
physical TF DTensor (see ``_layout``) plus static metadata: the mesh, the
placements and the global shape.  Being an ExtensionType, it passes through
``tf.function`` signatures, ``tf.nest`` and ``tf.GradientTape`` and takes part
in TF API dispatch (``tf.matmul(a, b)`` on DTensors runs ``_dispatch``).
"""

from __future__ import annotations

import functools
import typing
from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.framework import composite_tensor_gradient

from tfdist import _runtime
from tfdist.device_mesh import DeviceMesh, resolve_mesh
from tfdist.tensor._layout import (
    DTensorSpec,
    normalize_placements,
    placements_from_tf_layout,
    to_root_placements,
)
from tfdist.tensor._redistribute import redistribute_physical
from tfdist.tensor.placement_types import Partial, Placement, Replicate, Shard

# ChunkStorageMetadata is torch.distributed.checkpoint.metadata's; it is exported with tfdist.checkpoint
__all__ = ["DTensor", "distribute_tensor"]

# -- static metadata, interned so ExtensionType fields stay plain strings -----
_MESHES: dict[str, DeviceMesh] = {}


def _mesh_key(mesh: DeviceMesh) -> str:
    # DeviceMesh.key is computed once per mesh; every op wraps its result with it
    key = mesh.key
    _MESHES.setdefault(key, mesh)
    return key


@functools.lru_cache(maxsize=None)
def _parse_placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if text.startswith("S("):
        return Shard(int(text[2:-1]))
    return Partial(text[2:-1])


@functools.lru_cache(maxsize=4096)
def _spec_of(mesh_key: str, placements: tuple[str, ...], shape: tuple[int, ...]) -> DTensorSpec:
    return DTensorSpec(
        _MESHES[mesh_key], tuple(_parse_placement(p) for p in placements), shape
    )


def _in_graph() -> bool:
    return not tf.executing_eagerly()


def _require_eager(what: str) -> None:
    if _in_graph():
        raise RuntimeError(
            f"{what} needs eager mode: it packs or unpacks per-device tensors, "
            "which TF DTensor only allows outside tf.function (dtensor.pack/"
            "unpack raise in graphs). Call it before or after the tf.function, "
            "or stay in DTensor ops inside it."
        )


class ChunkStorageMetadata(typing.NamedTuple):
    """Size and global offset of one local shard (torch's checkpoint metadata)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class _DTensorGradient(composite_tensor_gradient.CompositeTensorGradient):
    """Gradients of a DTensor are DTensors with the same mesh and placements."""

    def get_gradient_components(self, value):
        return value._physical

    def replace_gradient_components(self, value, component_grads):
        if component_grads is None:
            return None
        if isinstance(component_grads, tf.IndexedSlices):
            component_grads = tf.convert_to_tensor(component_grads)
        # Partial placements hold per-device partial values; the gradient of
        # each is the (replicated) gradient of the reduced value, which the
        # physical gradient already is.  Relayout pins the expected layout.
        return DTensor._wrap(dtensor.relayout(component_grads, value._spec.tf_layout), value._spec)


class DTensor(tf.experimental.ExtensionType):
    """A tensor split over a DeviceMesh with one Placement per mesh dim.

    Use it like a ``tf.Tensor``: ``tf.matmul``, elementwise ops, reductions,
    ``tf.reshape``/``tf.transpose`` and Python operators run sharded through
    TF DTensor and return DTensors with the propagated placements.

    Example (8 virtual CPUs, 2x4 mesh)::

        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        x = distribute_tensor(tf.reshape(tf.range(16.0), (4, 4)), mesh, [Shard(0), Replicate()])
        y = x.redistribute(mesh, [Replicate(), Shard(1)])   # all-to-all on dp, slice on tp

    ========  ==========================  ============
    device    coordinate (dp, tp)         x's shard
    ========  ==========================  ============
    CPU:0-3   (0, 0..3)                   rows 0-1
    CPU:4-7   (1, 0..3)                   rows 2-3
    ========  ==========================  ============
    """

    _physical: tf.Tensor
    _mesh_key: str
    _placement_strs: typing.Tuple[str, ...]
    _global_shape: typing.Tuple[int, ...]

    __name__ = "tfdist.DTensor"
    __composite_gradient__ = _DTensorGradient()

    # -- construction helpers -------------------------------------------------
    @staticmethod
    def _wrap(physical: tf.Tensor, spec: DTensorSpec) -> DTensor:
        return DTensor(
            _physical=physical,
            _mesh_key=_mesh_key(spec.mesh),
            _placement_strs=tuple(str(p) for p in spec.placements),
            _global_shape=tuple(spec.shape),
        )

    @property
    def _spec(self) -> DTensorSpec:
        return _spec_of(self._mesh_key, self._placement_strs, self._global_shape)

    # -- metadata --------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        """The DeviceMesh this DTensor lives on (read-only)."""
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One Placement per dim of ``device_mesh`` (read-only)."""
        return self._spec.placements

    @property
    def shape(self) -> tf.TensorShape:
        """The global (logical) shape."""
        return tf.TensorShape(self._global_shape)

    @property
    def dtype(self) -> tf.DType:
        return self._physical.dtype

    @property
    def ndim(self) -> int:
        return len(self._global_shape)

    def __repr__(self) -> str:
        placements = ", ".join(repr(p) for p in self.placements)
        return (
            f"DTensor(shape={list(self._global_shape)}, dtype={self.dtype.name}, "
            f"device_mesh={self.device_mesh!r}, placements=({placements}{',' if len(self.placements) == 1 else ''}))"
        )

    # -- interop with raw TF DTensor ---------------------------------------------
    @staticmethod
    def from_tf(tf_dtensor: tf.Tensor) -> DTensor:
        """Wraps a TF DTensor (``tf.experimental.dtensor``), no copy (eager).

        Example:
            >>> t = dtensor.call_with_layout(tf.ones, layout, shape=(8, 4))
            >>> DTensor.from_tf(t).placements
            (Shard(dim=0),)
        """
        if not isinstance(tf_dtensor, tf.Tensor) or not dtensor.is_dtensor(tf_dtensor):
            raise TypeError(
                "from_tf expects a TF DTensor (a tf.Tensor with a dtensor layout). "
                f"Received: tf_dtensor={type(tf_dtensor).__name__}; for a plain "
                "tensor use distribute_tensor."
            )
        layout = dtensor.fetch_layout(tf_dtensor)
        mesh = DeviceMesh.from_tf(layout.mesh)
        spec = DTensorSpec(mesh, placements_from_tf_layout(layout), tuple(tf_dtensor.shape.as_list()))
        return DTensor._wrap(tf_dtensor, spec)

    def to_tf(self) -> tf.Tensor:
        """The global values as a TF DTensor with the matching TF layout.

        Free for even Shard/Replicate placements.  A Partial mesh dim is
        all-reduced and an uneven Shard is gathered first, because a TF
        layout can express neither.
        """
        spec = self._spec
        if not spec.partial_mesh_dims and not spec.uneven_dims:
            return self._physical
        fixed = [
            Replicate() if p.is_partial() or (isinstance(p, Shard) and p.dim in spec.uneven_dims) else p
            for p in self.placements
        ]
        return self.redistribute(self.device_mesh, fixed)._physical

    # -- local views ---------------------------------------------------------------
    @staticmethod
    def from_local(
        local_tensor: tf.Tensor | np.ndarray | Sequence[tf.Tensor],
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        grad_placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """Builds a DTensor from this client's local shards (eager, differentiable).

        Args:
            local_tensor: one tensor that every local device contributes (as
                when each torch rank runs the same line), or a list with one
                tensor per local device in mesh order (like ``dtensor.pack``).
            device_mesh: the mesh; default the current one (``with mesh:``).
            placements: one per mesh dim; default all ``Replicate()``.
            run_check: also check that replicas agree across replicated dims.
            shape: global shape; needed for uneven shards.  By default each
                sharded dim is ``local size * mesh dim size``.
            stride: accepted for torch compatibility; must be ``None`` or the
                row-major strides of ``shape`` (TF tensors have no strides).
            grad_placements: as torch's: the placements the gradient (a DTensor
                with ``placements``) is redistributed to before each device's local
                gradient is taken; they must give every device a local gradient of
                its local tensor's shape.  By default the gradient is the exact one
                (a single ``local_tensor`` used by every device gets the sum over the
                devices holding different parts, once per replicated copy).

        Example:
            >>> mesh = init_device_mesh("cpu", (8,))
            >>> DTensor.from_local(tf.ones((2, 3)), mesh, [Shard(0)]).shape
            TensorShape([16, 3])
        """
        _require_eager("DTensor.from_local")
        mesh = resolve_mesh(device_mesh, "from_local")
        locals_ = _as_local_list(local_tensor, mesh)
        ndim = locals_[0].shape.rank
        placements = normalize_placements(placements, mesh, ndim)
        global_shape = _global_shape(locals_[0], mesh, placements, shape)
        spec = DTensorSpec(mesh, placements, global_shape)
        _check_stride(stride, global_shape)
        coords = _root_coordinates(mesh)
        blocks = []
        for i, (t, coord) in enumerate(zip(locals_, coords)):
            want, _ = spec.local_shape_and_offset(coord)
            if tuple(t.shape.as_list()) != want:
                raise ValueError(
                    f"local tensor {i} (device {mesh.local_devices()[i]}) has shape "
                    f"{tuple(t.shape.as_list())} but global shape {global_shape} with "
                    f"placements {placements} gives it {want}. Pass shape= for "
                    "uneven shards, or fix the local tensor."
                )
            blocks.append(_to_physical_block(t, spec))
        if run_check:
            _check_replicas(blocks, coords, spec)
        grad_spec = spec if grad_placements is None else DTensorSpec(
            mesh, normalize_placements(grad_placements, mesh, ndim), global_shape)
        copies = _replica_counts(spec, coords) if _is_one_tensor(local_tensor) else [1] * len(blocks)
        return DTensor._wrap(_pack(blocks, spec, grad_spec, copies), spec)

    def local_tensors(self, *, grad_placements: Sequence[Placement] | None = None) -> list[tf.Tensor]:
        """This client's shards, one per local device in mesh order (eager, differentiable).

        The gradient of the DTensor is built from the local shards' gradients
        read with ``grad_placements`` (see :meth:`to_local`).
        """
        _require_eager("DTensor.local_tensors")
        spec = self._spec
        shape = _local_block_shape(spec)
        wants = [spec.local_shape_and_offset(coord)[0] for coord in _root_coordinates(spec.mesh)]
        out = []
        for block, want in zip(_unpack(self._physical, spec, wants, grad_placements), wants):
            block = tf.reshape(block, shape)  # drops the Partial and multi-mesh-dim axes (size 1 here)
            out.append(tf.slice(block, [0] * len(want), want))
        return out

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> tf.Tensor:
        """The shard of this client's first local device (eager, differentiable).

        torch gives each rank one device, so its ``to_local()`` is that
        device's shard.  A tfdist client may own several devices (8 virtual
        CPUs in one process); ``to_local()`` is then the shard of the first
        one in mesh order, and :meth:`local_tensors` returns all of them.

        Args:
            grad_placements: as torch's, how the local gradients combine into the
                DTensor's gradient: ``Shard`` -- they are its shards; ``Partial``
                -- they are summed (or reduced by its op); ``Replicate`` -- they are
                copies of one value (trusted, as torch does).  By default the
                DTensor's own placements, except that a ``Replicate`` mesh dim sums
                its copies' gradients: the exact gradient when only some copies
                were used (``to_local()`` uses the first device's).

        Example:
            >>> x = distribute_tensor(tf.ones((8, 2)), mesh, [Shard(0)])
            >>> with tf.GradientTape() as tape:
            ...     tape.watch(x._physical); loss = tf.reduce_sum(x.to_local() ** 2)
            >>> g = DTensor._wrap(tape.gradient(loss, x._physical), x._spec)  # 2 on the first shard, 0 elsewhere
        """
        return self.local_tensors(grad_placements=grad_placements)[0]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """Size and offset of each local device's shard, in mesh order."""
        spec = self._spec
        chunks = []
        for coord in _root_coordinates(spec.mesh):
            sizes, offsets = spec.local_shape_and_offset(coord)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        return chunks

    # -- global views and moves ------------------------------------------------------
    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> tf.Tensor:
        """The whole tensor, replicated on every device of the mesh.

        Returns a TF DTensor with a fully replicated layout (a ``tf.Tensor``;
        ``.numpy()`` works in eager).  Costs an all-gather per Shard mesh dim
        and an all-reduce per Partial mesh dim.  Differentiable.

        ``grad_placements`` may be ``None`` or all ``Replicate()``: the gradient
        of the result is one value that TF computes for the global program (the
        same on every device), which is torch's ``Replicate`` reading; torch's
        ``Partial``/``Shard`` readings describe per-rank gradients that differ,
        which a TF program does not produce, so they are refused.
        """
        if grad_placements is not None:
            given = normalize_placements(grad_placements, self.device_mesh, self.ndim)
            if not all(p.is_replicate() for p in given):
                raise ValueError(
                    "full_tensor: grad_placements must be None or all Replicate(): the gradient of the full tensor "
                    "is one global value, the same on every device (TF differentiates the global program), not "
                    f"per-rank partial or sharded gradients. Received: grad_placements={list(grad_placements)}")
        if len(self.device_mesh.local_device_ids()) == 0:  # a list; autograph mis-handles `not list`
            raise ValueError(
                "full_tensor() needs this client to own a device of the DTensor's "
                f"mesh; it owns none of {self.device_mesh!r}."
            )
        replicated = self.redistribute(self.device_mesh, [Replicate()] * self.device_mesh.ndim)
        return replicated._physical

    def numpy(self) -> np.ndarray:
        """The global value as a numpy array (eager)."""
        return self.full_tensor().numpy()

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> DTensor:
        """Moves to new placements with the collectives the transition needs.

        ``device_mesh`` may be the DTensor's mesh or another slice of the same
        root mesh: the placements then apply to that slice's dims and the
        DTensor's placements on its other dims are kept, which composes, e.g.,
        a tensor-parallel ``Shard`` on ``mesh["tp"]`` with a data-parallel one
        on ``mesh["dp"]`` into one layout on the parent mesh.
        ``async_op`` is accepted for torch compatibility: TF runs collectives
        asynchronously already and waits only where a value is needed.

        Raises:
            ValueError: placements missing, of the wrong length, or to Partial.
        """
        del async_op
        if placements is None:
            raise ValueError("redistribute needs placements. Received: placements=None")
        src = self._spec
        dst = _target_spec(src, device_mesh, placements)
        return DTensor._wrap(redistribute_physical(self._physical, src, dst), dst)

    # Keras layers take "tensors" only (``tf.is_tensor``); a DTensor is one, and
    # ``tf.convert_to_tensor`` turns it into its TF DTensor (registered below).
    @property
    def is_tensor_like(self) -> bool:
        return True

    # -- Python operators (dispatched to TF ops, see _dispatch) --------------------
    # elementwise, as torch and tf.Tensor (not ExtensionType's structural equality)
    def __eq__(self, other): return tf.math.equal(self, other)
    def __ne__(self, other): return tf.math.not_equal(self, other)
    __hash__ = None  # like tf.Tensor under elementwise ==, a DTensor is no dict key

    def __add__(self, other): return tf.math.add(self, other)
    def __radd__(self, other): return tf.math.add(other, self)
    def __sub__(self, other): return tf.math.subtract(self, other)
    def __rsub__(self, other): return tf.math.subtract(other, self)
    def __mul__(self, other): return tf.math.multiply(self, other)
    def __rmul__(self, other): return tf.math.multiply(other, self)
    def __truediv__(self, other): return tf.math.truediv(self, other)
    def __rtruediv__(self, other): return tf.math.truediv(other, self)
    def __pow__(self, other): return tf.math.pow(self, other)
    def __rpow__(self, other): return tf.math.pow(other, self)
    def __matmul__(self, other): return tf.linalg.matmul(self, other)
    def __rmatmul__(self, other): return tf.linalg.matmul(other, self)
    def __neg__(self): return tf.math.negative(self)
    def __abs__(self): return tf.math.abs(self)


# -- helpers ---------------------------------------------------------------------------
def _root_coordinates(mesh: DeviceMesh) -> list[tuple[int, ...]]:
    root = mesh.root_mesh
    return [tuple(c) for c in root.local_coordinates()]


def _as_local_list(local_tensor, mesh: DeviceMesh) -> list[tf.Tensor]:
    n_local = len(mesh.local_device_ids())
    if isinstance(local_tensor, (list, tuple)) and not local_tensor:
        raise ValueError(
            f"local_tensor is an empty list; give one tensor per local device ({n_local}) in mesh "
            "order, or a single tensor. Received: local_tensor=[]"
        )
    if isinstance(local_tensor, (list, tuple)) and local_tensor and not np.isscalar(local_tensor[0]) and not isinstance(local_tensor[0], (list, tuple)):
        if len(local_tensor) != n_local:
            raise ValueError(
                f"local_tensor is a list of {len(local_tensor)} tensors but this "
                f"client owns {n_local} devices of the mesh; give one per local "
                "device in mesh order, or a single tensor."
            )
        tensors = [tf.convert_to_tensor(t) for t in local_tensor]
    elif isinstance(local_tensor, DTensor):
        raise TypeError(
            "from_local expects local tf.Tensors, not a DTensor. Received: "
            f"local_tensor={local_tensor!r}; use redistribute to change placements."
        )
    else:
        try:
            tensors = [tf.convert_to_tensor(local_tensor)] * n_local
        except (TypeError, ValueError) as err:
            raise TypeError(
                "local_tensor must be a tensor, array or list of per-device tensors. "
                f"Received: local_tensor={type(local_tensor).__name__}"
            ) from err
    first = tensors[0]
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.shape.rank != first.shape.rank:
            raise ValueError(
                "all local tensors must share dtype and rank. Received: "
                f"{first.dtype.name}/{first.shape.rank}-D and {t.dtype.name}/{t.shape.rank}-D"
            )
    return tensors


def _global_shape(first, mesh, placements, shape) -> tuple[int, ...]:
    if shape is not None:
        shape = tuple(int(s) for s in shape)
        if len(shape) != first.shape.rank:
            raise ValueError(
                f"shape has {len(shape)} dims but the local tensors have "
                f"{first.shape.rank}. Received: shape={shape!r}"
            )
        return shape
    out = list(first.shape.as_list())
    for p, k in zip(placements, mesh.shape):
        if isinstance(p, Shard):
            out[p.dim] *= k
    return tuple(out)


def _check_stride(stride, shape) -> None:
    if stride is None:
        return
    expected = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    if tuple(stride) != expected:
        raise ValueError(
            "TF tensors are row-major with no custom strides; stride must be None "
            f"or {expected}. Received: stride={tuple(stride)!r}"
        )


def _local_block_shape(spec: DTensorSpec) -> list[int]:
    """Per logical dim, the size of one device's (padded) block."""
    out = []
    for d, n in enumerate(spec.shape):
        if d in spec.multi_dims:
            out.append(spec.leaf_size(d))
        elif d in spec.shard_mesh_dims:
            out.append(spec.padded_size(d) // spec.root_shape[spec.shard_mesh_dims[d]])
        else:
            out.append(n)
    return out


def _to_physical_block(t: tf.Tensor, spec: DTensorSpec) -> tf.Tensor:
    """Pads a local shard to its block and adds the Partial and multi-mesh-dim axes."""
    block = _local_block_shape(spec)
    pads = [[0, b - t.shape[d]] for d, b in enumerate(block)]
    if any(p[1] for p in pads):
        t = tf.pad(t, pads)
    shape = [1] * len(spec.partial_mesh_dims)
    for d, b in enumerate(block):
        shape += [1] * (spec.physical_dims(d) - 1) + [b]
    return tf.reshape(t, shape) if shape != t.shape.as_list() else t


def _is_one_tensor(local_tensor) -> bool:
    """from_local's single-tensor form (every local device contributes it), as ``_as_local_list`` reads it."""
    return not (isinstance(local_tensor, (list, tuple)) and local_tensor and not np.isscalar(local_tensor[0])
                and not isinstance(local_tensor[0], (list, tuple)))


def _replica_counts(spec: DTensorSpec, coords) -> list[int]:
    """Per local device, how many local devices hold the same part (they differ on Replicate mesh dims
    only): one tensor they all contribute is one value there, so each copy owns that share of its gradient."""
    varying = [m for m, p in enumerate(spec.root_placements) if not p.is_replicate()]
    keys = [tuple(c[m] for m in varying) for c in coords]
    return [keys.count(k) for k in keys]


def _pack(blocks: list[tf.Tensor], spec: DTensorSpec, grad_spec: DTensorSpec, copies: list[int]) -> tf.Tensor:
    """``dtensor.pack`` with torch's from_local backward: the gradient, redistributed to ``grad_spec``,
    gives each block its device's part (divided among the copies of one shared tensor)."""

    @tf.custom_gradient
    def pack(*blocks):
        def grad(dphys):
            g = DTensor._wrap(dtensor.relayout(dphys, spec.tf_layout), spec)
            if grad_spec.placements != spec.placements:
                g = g.redistribute(grad_spec.mesh, grad_spec.placements)
            parts = dtensor.unpack(g._physical)
            for i, (block, part) in enumerate(zip(blocks, parts)):
                if part.shape != block.shape:
                    raise ValueError(
                        f"from_local: grad_placements={list(grad_spec.placements)} give local device {i} a gradient "
                        f"block of shape {part.shape.as_list()}, but its local tensor's block has shape "
                        f"{block.shape.as_list()} (placements {list(spec.placements)}); choose grad_placements "
                        "that keep each device's local shape.")
            return [part / c if c != 1 else part for part, c in zip(parts, copies)]

        return dtensor.pack(list(blocks), spec.tf_layout), grad

    return pack(*blocks)


def _unpack(physical: tf.Tensor, spec: DTensorSpec, wants, grad_placements) -> list[tf.Tensor]:
    """``dtensor.unpack`` whose backward reads the local gradients with ``grad_placements`` (default: the
    DTensor's placements, Replicate mesh dims summing their copies) and redistributes the result back."""
    mesh = spec.mesh
    if grad_placements is None:
        read = tuple(Partial() if p.is_replicate() else p for p in spec.placements)
    else:
        read = normalize_placements(grad_placements, mesh, len(spec.shape))

    @tf.custom_gradient
    def unpack(x):
        parts = dtensor.unpack(x)

        def grad(*dparts):
            shape = _local_block_shape(spec)
            locals_ = [tf.slice(tf.reshape(tf.zeros_like(p) if d is None else d, shape), [0] * len(w), w)
                       for p, d, w in zip(parts, dparts, wants)]
            g = DTensor.from_local(locals_, mesh, read, shape=spec.shape)
            return g.redistribute(mesh, spec.placements)._physical if read != spec.placements else g._physical

        return parts, grad

    return unpack(physical)


def _check_replicas(blocks, coords, spec: DTensorSpec) -> None:
    """Devices that differ only on Replicate mesh dims must hold equal values."""
    varying = [m for m, p in enumerate(spec.root_placements) if not p.is_replicate()]
    first_of: dict[tuple, int] = {}
    for i, coord in enumerate(coords):
        key = tuple(coord[m] for m in varying)
        j = first_of.setdefault(key, i)
        if j != i and not bool(tf.reduce_all(tf.equal(blocks[i], blocks[j]))):
            raise ValueError(
                f"run_check: local tensors {j} and {i} should be replicas (their "
                f"devices differ only on Replicate mesh dims) but differ. "
                f"Received: placements={spec.placements!r}"
            )


def _target_spec(src: DTensorSpec, device_mesh, placements) -> DTensorSpec:
    mesh = src.mesh if device_mesh is None else device_mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh. Received: device_mesh={mesh!r}")
    if mesh.root_mesh != src.mesh.root_mesh:
        raise ValueError(
            "redistribute can only move within one root mesh (TF DTensor "
            f"relayouts stay on one mesh). DTensor mesh: {src.mesh!r}. "
            f"Received: device_mesh={mesh!r}"
        )
    placements = normalize_placements(placements, mesh, len(src.shape))
    if mesh == src.mesh:
        return DTensorSpec(mesh, placements, src.shape)
    # Compose: keep the placements on dims that ``mesh`` does not cover.
    root = to_root_placements(mesh, placements, base=src.root_placements)
    dims = sorted(set(mesh.root_dims) | {m for m in src.mesh.root_dims if not root[m].is_replicate()})
    union = mesh.root_mesh[tuple(mesh.root_mesh.axis_names[d] for d in dims)]
    composed = normalize_placements([root[d] for d in dims], union, len(src.shape))
    return DTensorSpec(union, composed, src.shape)


def _as_global_tensor(tensor) -> tf.Tensor:
    if isinstance(tensor, DTensor):
        raise ValueError(
            "distribute_tensor expects the global (logical) tensor, not a DTensor. "
            f"Received: tensor={tensor!r}; use tensor.redistribute(...) instead."
        )
    if isinstance(tensor, tf.Variable):
        return tensor.read_value()
    try:
        return tf.convert_to_tensor(tensor)
    except (TypeError, ValueError) as err:
        raise TypeError(
            "tensor must be a tf.Tensor, numpy array or nested list of numbers. "
            f"Received: tensor={type(tensor).__name__}"
        ) from err


def distribute_tensor(
    tensor: tf.Tensor | np.ndarray,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Splits a global tensor over a mesh according to ``placements``.

    Replicate->Shard is a local slice on every device: no communication.
    ``Partial`` is refused (torch refuses it too): build Partial values with
    ``DTensor.from_local``.

    Args:
        tensor: the global value (tf.Tensor, numpy array or nested list), or a
            raw TF DTensor (its global value is used).
        device_mesh: target mesh; default the current one (``with mesh:``).
        placements: one per mesh dim; default all ``Replicate()``.
        src_data_rank: the client whose value is the source of truth (0):
            in a multi-client run every client gets that client's value (a
            broadcast, run as one all-reduce), whatever it passed itself.
            ``None``: each client's own value is used for its devices (as in
            torch; replicas then disagree if the values differ).  With one
            client both mean the same.

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        >>> d = distribute_tensor(tf.zeros((6, 8)), mesh, [Shard(0), Shard(1)])
        >>> d.local_tensors()[0].shape   # rows 0-2, cols 0-1
        TensorShape([3, 2])
    """
    mesh = resolve_mesh(device_mesh, "distribute_tensor")
    if src_data_rank is not None and (
        isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int)
        or not 0 <= src_data_rank < max(1, _world_size())
    ):
        raise ValueError(
            f"src_data_rank must be None or a client rank in [0, {_world_size()}). "
            f"Received: src_data_rank={src_data_rank!r}"
        )
    if isinstance(tensor, tf.Tensor) and not _in_graph() and dtensor.is_dtensor(tensor):
        source = DTensor.from_tf(tensor)
        if source.device_mesh.root_mesh != mesh.root_mesh:
            raise ValueError(
                f"the TF DTensor lives on another mesh ({source.device_mesh!r}) than "
                f"device_mesh ({mesh!r}). Received: device_mesh={mesh!r}"
            )
        return source.redistribute(mesh, placements)
    value = _as_global_tensor(tensor)
    placements = normalize_placements(placements, mesh, value.shape.rank)
    for m, p in enumerate(placements):
        if p.is_partial():
            raise ValueError(
                f"distribute_tensor cannot create {p!r} (mesh dim {m}); use "
                f"DTensor.from_local for Partial values. Received: placements={placements!r}"
            )
    if not value.shape.is_fully_defined():
        raise ValueError(
            f"distribute_tensor needs a static shape. Received: tensor with shape {value.shape}"
        )
    replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(value.shape.as_list()))
    if src_data_rank is not None and _runtime.is_multi_client():
        physical = _broadcast_from_client(value, mesh, src_data_rank, replicated.tf_layout)
    else:  # one client, or torch's src_data_rank=None: each client's own value
        physical = dtensor.copy_to_mesh(value, replicated.tf_layout)
    target = DTensorSpec(mesh, placements, replicated.shape)
    return DTensor._wrap(redistribute_physical(physical, replicated, target), target)


def _broadcast_from_client(value: tf.Tensor, mesh: DeviceMesh, src: int, layout: dtensor.Layout) -> tf.Tensor:
    """``value`` as client ``src`` holds it, replicated on every device of every client.

    Each client contributes a block per local device to a tensor with one
    leading axis per mesh dim (sharded on it): client ``src``'s first device
    its value, every other device zeros.  Summing the leading axes is one
    all-reduce (TF's), after which every device holds ``src``'s value -- torch's
    broadcast from ``src_data_rank``, at an all-reduce's bytes.  Runs once,
    when a tensor is distributed.
    """
    root = mesh.root_mesh
    tf_mesh = root.to_tf()
    carrier = value if value.dtype.is_floating or value.dtype.is_integer or value.dtype.is_complex else None
    if carrier is None:
        if value.dtype != tf.bool:
            raise ValueError(f"distribute_tensor(src_data_rank=...) cannot broadcast dtype {value.dtype.name}.")
        carrier = tf.cast(value, tf.int32)
    lead = [1] * root.ndim
    mine = tf.reshape(carrier, lead + carrier.shape.as_list())
    zeros = tf.zeros_like(mine)
    blocks = [mine if (_runtime.get_rank() == src and i == 0) else zeros for i in range(len(tf_mesh.local_devices()))]
    stacked_layout = dtensor.Layout(list(root.axis_names) + [dtensor.UNSHARDED] * value.shape.rank, tf_mesh)
    stacked = dtensor.pack(blocks, stacked_layout)
    total = dtensor.relayout(tf.reduce_sum(stacked, axis=list(range(root.ndim))), layout)
    return total if carrier is value else tf.cast(total, value.dtype)


def _world_size() -> int:
    return _runtime.get_world_size()


def _convert_to_tf(value: DTensor, dtype=None, name=None, as_ref=False) -> tf.Tensor:
    out = value.to_tf()
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"cannot convert a {out.dtype.name} DTensor to {tf.as_dtype(dtype).name}")
    return out


# tf.convert_to_tensor(dtensor) -> the TF DTensor holding the same global value.
tf.register_tensor_conversion_function(DTensor, _convert_to_tf)


def client_0_value(value: typing.Any, mesh: DeviceMesh) -> np.ndarray:
    """The array client 0 passes as ``value`` (torch: a broadcast from rank 0), on every client;
    with one client, ``value`` itself.  Runs outside any step (a module's construction)."""
    if not _runtime.is_multi_client():
        return np.asarray(value)
    root = mesh.root_mesh
    return distribute_tensor(np.asarray(value), root, [Replicate()] * root.ndim, src_data_rank=0).to_local().numpy()

