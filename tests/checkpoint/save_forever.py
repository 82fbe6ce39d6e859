"""Child of test_kill.py: saves version 1, 2, 3, ... into one checkpoint directory until killed.

Version i holds w = full(i) (sharded over 8 devices) and i.  It prints
"phase data i" before writing data, "phase meta i" in the middle of the
metadata write (slowed down so a kill can land there) and "saved i" once
save() returned.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tfdist  # noqa: E402

tfdist.virtual_cpus(8)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist.checkpoint as dcp  # noqa: E402
from tfdist.checkpoint import _tf_io, filesystem  # noqa: E402
from tfdist.tensor import Shard, distribute_tensor  # noqa: E402

path = sys.argv[1]
version = 0
original_bundle, original_atomic = _tf_io.write_bundle, filesystem._write_atomically


def announced_bundle(*args, **kwargs):
    print(f"phase data {version}", flush=True)
    return original_bundle(*args, **kwargs)


def slow_metadata(target, data, sync):
    if target.name != ".metadata":
        return original_atomic(target, data, sync)
    tmp = target.with_name(f"{target.name}.tmp-child")
    with open(tmp, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        print(f"phase meta {version}", flush=True)
        time.sleep(0.2)
        f.write(data[len(data) // 2:])
    os.replace(tmp, target)


_tf_io.write_bundle = announced_bundle
filesystem._write_atomically = slow_metadata
mesh = tfdist.init_device_mesh("cpu", (8,))
print("ready", flush=True)
while True:
    version += 1
    w = distribute_tensor(np.full((64, 32), version, np.float32), mesh, [Shard(0)])
    dcp.save({"w": w, "version": version, "b": tf.fill([5], float(version))}, checkpoint_id=path)
    print(f"saved {version}", flush=True)
