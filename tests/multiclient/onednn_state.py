"""Prints whether TF's oneDNN kernels are on in this launched process, and the variable's value."""
import os

import tensorflow as tf  # noqa: F401  (TF decides oneDNN when it loads)
from tensorflow.python.util import _pywrap_util_port

print(f"OK rank {os.environ.get('RANK')}: oneDNN {_pywrap_util_port.IsMklEnabled()} "
      f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS')}", flush=True)
