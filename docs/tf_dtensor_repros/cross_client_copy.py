"""TF DTensor (2.21) cannot copy a tensor from one client's devices to another client's.

    python -m tfdist.run --nproc-per-node 2 --devices-per-proc 2 docs/tf_dtensor_repros/cross_client_copy.py

A multi-client pipeline must move activations from the client holding stage s
to the client holding stage s + 1.  ``dtensor.copy_to_mesh`` from a 1-device
mesh on client 0 to a 1-device mesh on client 1 fails in SPMD expansion:
``dtensor_op_spmd_expander.cc`` checks
``if (send_hosts != recv_hosts) return InvalidArgumentError("Send and receive hosts don't match")``.
An all-gather over a 2-device mesh holding one device of each client does
work (printed below), so a transfer between clients has to be a collective.
Exit status 1 on the client that sees the copy refused.
"""

import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfdist  # noqa: E402

tfdist.init_process_group()
rank = tfdist.get_rank()
device = dtensor.local_devices("CPU")[0]
device = device.to_string() if hasattr(device, "to_string") else device


def one_device_mesh(owner: int) -> dtensor.Mesh:
    mine = rank == owner
    return dtensor.Mesh(["x"], np.arange(1), [0] if mine else [], [device] if mine else [],
                        global_devices=[re.sub(r"task:\d+", f"task:{owner}", device)])


refused = False
try:
    src = dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(one_device_mesh(0), 1), shape=[4])
    dtensor.copy_to_mesh(src, dtensor.Layout.replicated(one_device_mesh(1), 1))
except Exception as e:  # noqa: BLE001
    refused = "Send and receive hosts don't match" in str(e)
    print(f"rank {rank}: copy_to_mesh refused: {type(e).__name__}: {str(e)[:120]}", flush=True)

pair = dtensor.Mesh(["pp"], np.arange(2), [rank], [device])
with tf.device(device):
    piece = tf.fill([1, 4], float(rank + 1))
both = tf.function(lambda t: dtensor.relayout(t, dtensor.Layout.replicated(pair, 2)))(
    dtensor.pack([piece], dtensor.Layout.batch_sharded(pair, "pp", 2)))
print(f"rank {rank}: all-gather over the pair works: {dtensor.unpack(both)[0].numpy()[:, 0].tolist()}", flush=True)
tfdist.barrier()
sys.exit(1 if refused else 0)
