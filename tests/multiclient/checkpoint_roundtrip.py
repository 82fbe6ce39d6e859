"""Run under `tfdist run`: save a sharded state from N clients, or load one into this many clients.

    checkpoint_roundtrip.py save <dir>   # every client writes its own shards
    checkpoint_roundtrip.py load <dir>   # any number of clients; checked against numpy
    checkpoint_roundtrip.py broadcast -  # set_model_state_dict(broadcast_from_rank0=True)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
import tfdist.checkpoint as dcp  # noqa: E402
from tfdist.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

mode, path = sys.argv[1], sys.argv[2]
world, rank = int(os.environ.get("WORLD_SIZE", "1")), tfdist.get_rank()
X = np.arange(12 * 20, dtype=np.float32).reshape(12, 20)
tfdist.init_process_group()
mesh = tfdist.init_device_mesh("cpu", (2, world), mesh_dim_names=("dp", "tp"))
if mode == "save":
    sd = {"w": distribute_tensor(X, mesh, [Shard(0), Shard(1)]),
          "r": distribute_tensor(X[0], mesh, [Replicate(), Replicate()]), "meta": {"step": 5}}
    dcp.save(sd, checkpoint_id=path)
    files = sorted(os.listdir(path))
    print(f"OK saved rank {rank} {files}", flush=True)
elif mode == "broadcast":
    import keras

    import tfdist.keras  # noqa: F401
    from tfdist.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from tfdist.tensor.parallel import ColwiseParallel, parallelize_module

    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(20, name="dense")])
    parallelize_module(model, mesh["tp"], {"dense": ColwiseParallel()})
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    bad = {"dense.kernel": X[:, :12].copy(), "dense.bias": X[0]} if rank == 0 else {}
    try:  # a wrong shape on rank 0 is refused on every client, before any collective
        set_model_state_dict(model, bad, options=options)
        raise AssertionError("no error")
    except ValueError as e:
        assert "'dense.kernel' has shape (12, 12)" in str(e), e
    sd = {"dense.kernel": X.copy(), "dense.bias": X[0]} if rank == 0 else {}
    set_model_state_dict(model, sd, options=options)
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    np.testing.assert_array_equal(np.asarray(got["dense.kernel"]), X)
    np.testing.assert_array_equal(np.asarray(got["dense.bias"]), X[0])
    tfdist.barrier()
    print(f"OK broadcast rank {rank}", flush=True)
else:
    flat = tfdist.init_device_mesh("cpu", (2 * world,), mesh_dim_names=("x",))
    sd = {"w": distribute_tensor(np.zeros_like(X), flat, [Shard(1)]),
          "r": distribute_tensor(np.zeros(20, np.float32), mesh, [Replicate(), Shard(0)]), "meta": {"step": 0}}
    dcp.load(sd, checkpoint_id=path)
    for local, (j,) in zip(sd["w"].local_tensors(), flat.local_coordinates()):
        c = -(-20 // (2 * world))
        np.testing.assert_array_equal(local.numpy(), X[:, c * j: c * (j + 1)])
    np.testing.assert_array_equal(sd["r"].full_tensor().numpy(), X[0])
    assert sd["meta"]["step"] == 5
    tfdist.barrier()
    print(f"OK loaded rank {rank} of {world}", flush=True)
