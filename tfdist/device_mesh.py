"""DeviceMesh: a named, n-dimensional arrangement of devices over a TF DTensor mesh.

A ``DeviceMesh`` wraps one ``tf.experimental.dtensor.Mesh`` (its *root*).
Slicing by dim names (``mesh["tp"]``, ``mesh["dp", "tp"]``) gives a mesh that
keeps its root: TF DTensor has no sub-meshes, so a DTensor placed on a slice
is laid out on the root mesh with ``Replicate`` on the dims the slice leaves
out.  That is what lets placements given on ``mesh["dp"]`` and ``mesh["tp"]``
compose into one layout on the parent 2-D mesh.
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.framework import device as tf_dev

from tfdist import _runtime

__all__ = ["DeviceMesh", "init_device_mesh"]

_current = threading.local()  # stack of meshes entered with ``with mesh:``

_FORBIDDEN_NAME_CHARS = set(",|=: ")


def _check_dim_names(names: Sequence[str], ndim: int) -> tuple[str, ...]:
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(
            f"mesh_dim_names has {len(names)} entries but the mesh has {ndim} "
            f"dims. Received: mesh_dim_names={names!r}"
        )
    for name in names:
        if not isinstance(name, str) or not name or set(name) & _FORBIDDEN_NAME_CHARS:
            raise ValueError(
                "each mesh dim name must be a non-empty str without any of "
                f"{sorted(_FORBIDDEN_NAME_CHARS)}. Received: mesh_dim_names={names!r}"
            )
    if len(set(names)) != len(names):
        raise ValueError(
            f"mesh_dim_names must be unique. Received: mesh_dim_names={names!r}"
        )
    return names


def _check_gather_order(device_type: str, ids: np.ndarray) -> None:
    """Refuses a device order TF's CollectiveGatherV2 lowering gets wrong.

    That lowering (on for CPU and GPU meshes, ``_runtime``) concatenates each gather group's parts in
    the order TF's collective executor ranks the group's devices -- ascending (task, device index),
    not the mesh coordinate DTensor assumed -- so a mesh whose ids fall along a dim returns the
    gathered parts in the wrong places, silently
    (docs/tf_dtensor_repros/gather_lowering_device_order.py).
    """
    if device_type == "TPU" or not _runtime.gather_lowering_is_collective():
        return
    for d in range(ids.ndim):
        if ids.shape[d] > 1 and not np.all(np.diff(ids, axis=d) > 0):
            raise ValueError(
                f"mesh: on a {device_type} mesh the device ids must increase along every mesh dim (dim {d} "
                f"does not): TF DTensor's all-gather lowering, which tfdist turns on for its bytes, puts the "
                f"gathered parts in device order and would return wrong values. Order the devices "
                f"ascending, or set TFDIST_GATHER_LOWERING=reduce before importing tfdist (TF's all-reduce "
                f"lowering: any order, 2x the gather bytes). Received: mesh={ids.tolist()!r}"
            )


def _build_tf_mesh(
    device_type: str, ids: np.ndarray, names: tuple[str, ...]
) -> dtensor.Mesh:
    """A dtensor.Mesh whose mesh positions hold the devices ``ids``.

    TF DTensor numbers mesh positions 0..n-1 in row-major order and maps
    position ``p`` to the client's ``p``-th listed device, so an arbitrary
    device order is a permutation of that list (ascending along every dim
    while TF's gather lowering is on: ``_check_gather_order``).  Across
    clients each client must own a contiguous block of positions.
    """
    _check_gather_order(device_type, ids)
    if _runtime.is_multi_client() and ids.size != _runtime.num_global_devices(device_type):
        return _build_sub_tf_mesh(device_type, ids, names)
    n_global = ids.size
    n_local = n_global // _runtime.get_world_size()
    first = _runtime.get_rank() * n_local
    positions = list(range(first, first + n_local))
    flat = ids.ravel().tolist()
    owned = flat[first:first + n_local]
    if _runtime.is_multi_client() and sorted(owned) != positions:
        raise ValueError(
            f"with {_runtime.get_world_size()} clients, client {_runtime.get_rank()} "
            f"must own mesh positions {positions[0]}..{positions[-1]}; its devices "
            f"can be permuted among themselves only. Received: mesh={ids.tolist()!r}"
        )
    # dtensor.local_devices gives fully qualified names (job/replica/task),
    # which TF DTensor needs to place the mesh.
    devices = dtensor.local_devices(device_type)
    local_devices = [devices[i - first if _runtime.is_multi_client() else i] for i in owned]
    return dtensor.Mesh(
        dim_names=list(names),
        global_device_ids=np.arange(n_global).reshape(ids.shape),
        local_device_ids=positions,
        local_devices=local_devices,
    )


def global_device_name(local_example: str, device_id: int, per_client: int) -> str:
    """The full name of global device ``device_id`` (client ``id // per_client``, its ``id % per_client``-th
    device), written like this client's ``local_example`` (every client has the same devices)."""
    spec = tf_dev.DeviceSpec.from_string(local_example)
    return spec.replace(task=device_id // per_client, device_index=device_id % per_client).to_string()


def sub_mesh_spec(device_type: str, ids: np.ndarray, names: tuple[str, ...]) -> dict:
    """What every client needs to build the TF mesh of ``ids`` (a subset of the global devices):
    its shape, dim names and the full name of the device at each position."""
    local = dtensor.local_devices(device_type)
    per_client = len(local)
    return {"shape": list(ids.shape), "names": list(names),
            "devices": [global_device_name(_name(local[0]), int(i), per_client) for i in ids.ravel()]}


def _name(device: Any) -> str:
    return device.to_string() if hasattr(device, "to_string") else str(device)


def tf_mesh_from_spec(spec: dict) -> dtensor.Mesh:
    """The TF mesh ``sub_mesh_spec`` describes, as this client sees it: its own devices local, or a
    *remote* mesh (no local devices; TF DTensor lowers ops on it and skips running them)."""
    me = _runtime.get_rank()
    positions = [p for p, d in enumerate(spec["devices"]) if tf_dev.DeviceSpec.from_string(d).task == me]
    return dtensor.Mesh(
        dim_names=spec["names"],
        global_device_ids=np.arange(len(spec["devices"])).reshape(spec["shape"]),
        local_device_ids=positions,
        local_devices=[spec["devices"][p] for p in positions],
        global_devices=list(spec["devices"]),
    )


def reserve_collective_keys(tf_mesh: dtensor.Mesh) -> None:
    """Gives every group of devices of ``tf_mesh`` its collective key on every client, now.

    TF DTensor keys a collective by a per-process counter, bumped the first time it lowers a
    collective over a given (mesh, group of mesh dims) and cached after that
    (``GetCollectiveKeyBase`` in tensorflow/dtensor/mlir/collectives.cc). Clients that later run
    different sub-meshes' programs (pipeline stages) would draw the same number for different groups,
    and TF's collective group leader refuses the second ("joining a group that is already full").
    Lowering one reduction over every subset of the mesh's dims here, on every client in the same
    order (on a client outside the mesh TF lowers and skips it), fixes each group's key before any
    client's programs diverge (docs/design.md, "A stage whose sub-mesh spans clients").
    """
    dims = list(tf_mesh.dim_names)
    for size in range(1, len(dims) + 1):
        for subset in itertools.combinations(dims, size):
            layout = dtensor.Layout(list(subset), tf_mesh)
            ones = dtensor.call_with_layout(tf.ones, layout, shape=[tf_mesh.dim_size(d) for d in subset])
            tf.reduce_sum(ones)  # an all-reduce over ``subset``
            dtensor.relayout(ones, dtensor.Layout.replicated(tf_mesh, size))  # an all-gather over it


def _build_sub_tf_mesh(device_type: str, ids: np.ndarray, names: tuple[str, ...]) -> dtensor.Mesh:
    """A mesh over some of the global devices of a multi-client job (a pipeline stage's sub-mesh).

    Each client's devices must sit at consecutive mesh positions (TF DTensor gives each client one
    block). Every client builds every sub-mesh, in the same order, as torch's ``new_group`` is called
    by every rank: a client that owns none of its devices gets a *remote* mesh (it cannot compute on
    it), and the collective keys of the mesh's device groups are fixed on all clients alike.
    """
    per_client = len(dtensor.local_devices(device_type))
    flat = ids.ravel().tolist()
    clients = [i // per_client for i in flat]
    blocks = [c for k, c in enumerate(clients) if k == 0 or clients[k - 1] != c]
    if len(blocks) != len(set(blocks)):
        raise ValueError(
            f"mesh: each client's devices must sit at consecutive mesh positions (row-major); their clients "
            f"here are {clients}. Received: mesh={ids.tolist()!r}"
        )
    tf_mesh = tf_mesh_from_spec(sub_mesh_spec(device_type, ids, names))
    reserve_collective_keys(tf_mesh)
    return tf_mesh


def _device_ids(tf_mesh: dtensor.Mesh) -> np.ndarray:
    """Device id at each mesh position (the ``mesh`` array torch shows)."""
    shape = tf_mesh.shape()
    ids = np.asarray(tf_mesh.global_device_ids()).reshape(shape)
    if _runtime.is_multi_client():
        if tf_mesh.size < _runtime.num_global_devices(tf_mesh.device_type()):  # a sub-mesh: its device ids
            per_client = len(dtensor.local_devices(tf_mesh.device_type()))
            specs = [tf_dev.DeviceSpec.from_string(d) for d in tf_mesh.global_devices()]
            return np.asarray([s.task * per_client + s.device_index for s in specs]).reshape(shape)
        return ids
    # One client: a position's device id is the index of the device it maps to.
    index = [tf_dev.DeviceSpec.from_string(d).device_index for d in tf_mesh.local_devices()]
    by_position = dict(zip(tf_mesh.local_device_ids(), index))
    return np.vectorize(by_position.__getitem__)(ids) if ids.size else ids


class DeviceMesh:
    """An n-D mesh of devices with named dims, over a TF DTensor mesh.

    Prefer :func:`init_device_mesh`.  Direct construction takes the global
    device ids laid out in the mesh's shape (torch's ``mesh`` argument).

    Args:
        device_type: ``"cpu"``, ``"gpu"`` (or ``"cuda"``) or ``"tpu"``.
        mesh: array-like of global device ids; its shape is the mesh shape.
        mesh_dim_names: one name per mesh dim; ``None`` leaves the mesh
            unnamed (it then cannot be sliced by name).

    In a multi-client job a mesh over some of the devices (a pipeline
    stage's sub-mesh) is built by *every* client, in the same order, as
    torch's ``new_group`` is called by every rank; each client's devices sit
    at consecutive positions. On a client owning none of its devices the mesh
    is remote (``is_remote()``; ``get_coordinate()`` is ``None``).

    Example:
        >>> mesh = DeviceMesh("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=("dp", "tp"))
        >>> mesh["tp"].size(), mesh.shape
        (4, (2, 4))
    """

    def __init__(
        self,
        device_type: str,
        mesh: Sequence | np.ndarray,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> None:
        tf_type = _runtime.normalize_device_type(device_type)
        _runtime.initialize_accelerators(tf_type)  # multi-client needs it to count devices
        try:
            ids = np.asarray(mesh)
        except ValueError:  # ragged rows: numpy's own words would not name the argument
            ids = np.asarray(0)
        if ids.ndim == 0 or ids.dtype.kind not in "iu":
            raise ValueError(
                "mesh must be an n-D array of integer device ids. "
                f"Received: mesh={mesh!r}"
            )
        n = _runtime.num_global_devices(tf_type)
        flat = ids.ravel().tolist()
        # any subset of the devices (a pipeline stage's sub-mesh), in one client or across clients
        if len(set(flat)) != len(flat) or not all(0 <= i < n for i in flat):
            raise ValueError(
                f"mesh must hold distinct {tf_type} device ids in 0..{n - 1}. Received: mesh={ids.tolist()!r}"
            )
        named = mesh_dim_names is not None
        names = (
            _check_dim_names(mesh_dim_names, ids.ndim)
            if named
            else tuple(f"dim_{i}" for i in range(ids.ndim))
        )
        self._init_from_tf(_build_tf_mesh(tf_type, ids, names), named=named)

    def _init_from_tf(
        self,
        tf_mesh: dtensor.Mesh,
        *,
        named: bool = True,
        dims: tuple[int, ...] | None = None,
        root: DeviceMesh | None = None,
    ) -> None:
        self._tf_mesh = tf_mesh
        self._named = named
        self._dims = tuple(range(len(tf_mesh.dim_names))) if dims is None else dims
        self._root = root
        # the one identity of a mesh: equality, hashing and DTensor metadata use it
        self._key = f"{tf_mesh.to_string()}#{self._dims}#{named}"
        self._ids = _device_ids(tf_mesh) if root is None else root._ids

    @classmethod
    def from_tf(cls, tf_mesh: dtensor.Mesh) -> DeviceMesh:
        """Wraps an existing ``tf.experimental.dtensor.Mesh`` (no copy).

        Example:
            >>> tfm = dtensor.create_mesh([("x", 8)], device_type="CPU")
            >>> DeviceMesh.from_tf(tfm).mesh_dim_names
            ('x',)
        """
        if not isinstance(tf_mesh, dtensor.Mesh):
            raise TypeError(
                "from_tf expects a tf.experimental.dtensor.Mesh. "
                f"Received: tf_mesh={tf_mesh!r}"
            )
        mesh = cls.__new__(cls)
        mesh._init_from_tf(tf_mesh)
        return mesh

    def to_tf(self) -> dtensor.Mesh:
        """The TF DTensor mesh.  For a slice, the root mesh it lives on."""
        return self._tf_mesh

    # -- shape and names -------------------------------------------------
    @property
    def root_mesh(self) -> DeviceMesh:
        """The mesh this one was sliced from (itself when it is a root)."""
        return self if self._root is None else self._root

    @property
    def root_dims(self) -> tuple[int, ...]:
        """Indices of this mesh's dims among the root mesh's dims."""
        return self._dims

    @property
    def device_type(self) -> str:
        """Lower-case device type: ``"cpu"``, ``"gpu"`` or ``"tpu"``."""
        return self._tf_mesh.device_type().lower()

    @property
    def ndim(self) -> int:
        return len(self._dims)

    @property
    def shape(self) -> tuple[int, ...]:
        root_shape = self._tf_mesh.shape()
        return tuple(root_shape[d] for d in self._dims)

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        if not self._named:
            return None
        return tuple(self._tf_mesh.dim_names[d] for d in self._dims)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Dim names as TF DTensor knows them (generated when the mesh is unnamed)."""
        return tuple(self._tf_mesh.dim_names[d] for d in self._dims)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of devices in the mesh, or along one mesh dim (index or name)."""
        if mesh_dim is None:
            return math.prod(self.shape)
        return self.shape[self._dim_index(mesh_dim)]

    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if mesh_dim not in self.axis_names or not self._named:
                raise ValueError(
                    f"mesh_dim {mesh_dim!r} is not a dim of this mesh; its dims are "
                    f"{self.mesh_dim_names}. Received: mesh_dim={mesh_dim!r}"
                )
            return self.axis_names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int) or not (
            -self.ndim <= mesh_dim < self.ndim
        ):
            raise ValueError(
                f"mesh_dim must be a dim name or an index in [{-self.ndim}, "
                f"{self.ndim}). Received: mesh_dim={mesh_dim!r}"
            )
        return mesh_dim % self.ndim

    # -- devices and coordinates ----------------------------------------------
    # A *position* is TF DTensor's row-major index of a mesh cell; the device
    # id shown to users (``mesh``) is the device sitting there.
    def _position_coordinate(self, position: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(position, self._tf_mesh.shape()))

    @property
    def mesh(self) -> np.ndarray:
        """Device ids of this mesh (for a slice: the group of this client's first device)."""
        if self.is_remote():
            return self._ids
        coord = self._position_coordinate(self._tf_mesh.local_device_ids()[0])
        index = tuple(
            slice(None) if d in self._dims else coord[d] for d in range(self._ids.ndim)
        )
        return self._ids[index]

    def is_remote(self) -> bool:
        """True on a client that owns none of this mesh's devices (a sub-mesh of other clients)."""
        return self._tf_mesh.is_remote()

    def local_device_ids(self) -> list[int]:
        """Ids of this client's devices, in mesh order."""
        return [int(self._ids.flat[p]) for p in self._tf_mesh.local_device_ids()]

    def local_devices(self) -> list[str]:
        """Names of this client's devices, in mesh order."""
        return list(self._tf_mesh.local_devices())

    def get_coordinate(self) -> list[int]:
        """Mesh coordinate of this client's first device.

        torch gives each rank one device; here one client may own several, so
        this is the coordinate of the first one (see :meth:`local_coordinates`); ``None`` on a client
        outside the mesh, as torch's ``get_coordinate`` for a rank outside it.
        """
        coords = self.local_coordinates()
        return coords[0] if coords else None

    def local_coordinates(self) -> list[list[int]]:
        """Mesh coordinates of every local device, in mesh order."""
        return [
            [self._position_coordinate(p)[d] for d in self._dims]
            for p in self._tf_mesh.local_device_ids()
        ]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This client's (first device's) index along ``mesh_dim``."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"mesh_dim is required for a {self.ndim}-D mesh. Received: mesh_dim=None"
                )
            mesh_dim = 0
        return self.get_coordinate()[self._dim_index(mesh_dim)]

    # -- slicing ---------------------------------------------------------------
    def get_group(self, mesh_dim: int | str | None = None) -> DeviceMesh:
        """The group along ``mesh_dim``: in tfdist, the 1-D mesh of that dim (what ``mesh["tp"]``
        gives), which tfdist takes wherever torch takes a group (functional collectives'
        ``group``). TF DTensor has no process groups; a 1-D mesh stands for one group per
        coordinate of the other dims, as torch's ``get_group`` returns each rank its own group. On
        a 1-D mesh ``mesh_dim`` may be left out.

        Example:
            >>> mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            >>> tp = mesh.get_group("tp")       # funcol.all_reduce(x, "sum", tp)
            >>> tp.shape, mesh.get_group(0) == mesh["dp"]
            ((4,), True)
        """
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"mesh_dim is required for a {self.ndim}-D mesh (which of {self.axis_names}). "
                                 "Received: mesh_dim=None")
            return self
        d = self._dim_index(mesh_dim)
        if self.ndim == 1:
            return self
        child = DeviceMesh.__new__(DeviceMesh)
        child._init_from_tf(self._tf_mesh, named=self._named, dims=(self._dims[d],), root=self.root_mesh)
        return child

    def get_all_groups(self) -> list[DeviceMesh]:
        """``get_group`` of every mesh dim, in order."""
        return [self.get_group(d) for d in range(self.ndim)]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if not self._named:
            raise KeyError(
                "this mesh has no mesh_dim_names, so it cannot be sliced by name; "
                "create it with init_device_mesh(..., mesh_dim_names=(...))."
            )
        if not isinstance(names, str) and not (
            isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names)
        ):
            raise TypeError(
                f"mesh[...] takes mesh dim names: a str or a tuple of str from {self.axis_names}. "
                f"Received: {names!r}"
            )
        wanted = (names,) if isinstance(names, str) else tuple(names)
        own = self.axis_names
        unknown = [n for n in wanted if n not in own]
        if unknown or not wanted or len(set(wanted)) != len(wanted):
            raise KeyError(
                f"mesh dim names {wanted!r} must be distinct dims of this mesh, "
                f"which has {own}. Received: {names!r}"
            )
        positions = [own.index(n) for n in wanted]
        if positions != sorted(positions):
            raise KeyError(
                f"slice dims in the mesh's order {own}. Received: {names!r}"
            )
        if len(wanted) == self.ndim:
            return self
        child = DeviceMesh.__new__(DeviceMesh)
        child._init_from_tf(
            self._tf_mesh,
            dims=tuple(self._dims[p] for p in positions),
            root=self.root_mesh,
        )
        return child

    # -- ``with mesh:`` makes this the default mesh, as in torch -----------------
    def __enter__(self) -> DeviceMesh:
        _mesh_stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _mesh_stack().pop()

    @property
    def key(self) -> str:
        """A string that identifies this mesh (devices, dim names, slice): equal meshes share it."""
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self._named else ""
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """Builds a mesh over every device of ``device_type`` on all clients.

    Devices are laid out in row-major order of their global ids, the same in
    every client, so a multi-client program builds one identical mesh.

    Args:
        device_type: ``"cpu"``, ``"gpu"``/``"cuda"`` or ``"tpu"``.
        mesh_shape: devices per mesh dim; the product must equal the number
            of global devices.
        mesh_dim_names: one unique name per dim (needed to slice the mesh).

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        >>> mesh
        DeviceMesh('cpu', [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=('dp', 'tp'))
    """
    tf_type = _runtime.normalize_device_type(device_type)
    _runtime.initialize_accelerators(tf_type)
    shape = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else None
    if not shape or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape
    ):
        raise ValueError(
            "mesh_shape must be a non-empty tuple of positive ints. "
            f"Received: mesh_shape={mesh_shape!r}"
        )
    n = _runtime.num_global_devices(tf_type)
    if n == 0:
        raise ValueError(
            f"init_device_mesh({device_type!r}, ...) found no {tf_type} device on this host "
            f"(device type detected: {_runtime.detect_device_type().lower()!r}). Use "
            "init_device_mesh('cpu', ...) (tfdist.virtual_cpus(n) splits the CPU into n devices) or run "
            f"on a machine with {tf_type}s. Received: device_type={device_type!r}"
        )
    if math.prod(shape) != n:
        raise ValueError(
            f"mesh_shape {shape} holds {math.prod(shape)} devices but there are "
            f"{n} {tf_type} devices over all clients; make the product equal {n}"
            f"{' (tfdist.virtual_cpus(k) sets the CPU count)' if tf_type == 'CPU' else ''}. "
            f"Received: mesh_shape={mesh_shape!r}"
        )
    if mesh_dim_names is not None:
        _check_dim_names(mesh_dim_names, len(shape))
    return DeviceMesh(
        device_type, np.arange(n).reshape(shape), mesh_dim_names=mesh_dim_names
    )



def _mesh_stack() -> list[DeviceMesh]:
    if not hasattr(_current, "stack"):
        _current.stack = []
    return _current.stack


def default_data_parallel_mesh() -> DeviceMesh:
    """torch's default for FSDP and DDP: the innermost ``with mesh:``, else every device on one
    data-parallel dim ``dp``."""
    stack = _mesh_stack()
    if stack:
        return stack[-1]
    kind = _runtime.detect_device_type()
    return init_device_mesh(kind, (_runtime.num_global_devices(kind),), mesh_dim_names=("dp",))


def resolve_mesh(device_mesh: DeviceMesh | None, caller: str) -> DeviceMesh:
    """``device_mesh`` if given, else the innermost ``with mesh:``; else a clear error."""
    if device_mesh is None:
        stack = _mesh_stack()
        if not stack:
            raise ValueError(
                f"{caller} needs a device_mesh: pass one, or call it inside "
                "`with mesh:`. Received: device_mesh=None"
            )
        device_mesh = stack[-1]
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            "device_mesh must be a tfdist DeviceMesh. Received: "
            f"device_mesh={type(device_mesh).__name__}; wrap a dtensor.Mesh with "
            "DeviceMesh.from_tf."
        )
    return device_mesh
