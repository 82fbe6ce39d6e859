"""Every private Keras name tfdist reads, imported in one place.

Keras 3 exports no public spelling for these; each is here with what tfdist needs it for, so a
Keras upgrade that moves one breaks this module's import (at ``import tfdist.keras``) instead of a
call deep inside a step. The methods tfdist wraps are not here: they are rows of the patch table
(``tfdist/_patches.py``), which names each by its ``keras.src`` path and checks its parameters.
Where a public name exists (``keras.tree``, ``keras.callbacks.CallbackList``) tfdist uses it.
"""

from __future__ import annotations

# the distribution scope Keras reads (``keras.distribution.distribution()`` has no setter for a
# thread-local override) and Keras' symbolic/stateless tracing state
from keras.src.backend.common import KerasVariable, global_state
from keras.src.backend.common.keras_tensor import any_symbolic_tensors
from keras.src.backend.common.stateless_scope import in_stateless_scope

# the TensorFlow backend's random draws (seeds of dropout and noise layers) and trainer
from keras.src.backend.tensorflow import random as tf_random
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

# the base class of a Keras distribution, and the module holding the global one
from keras.src.distribution import distribution_lib
from keras.src.distribution.distribution_lib import Distribution

# the loss module (its loss scaling for distribution), the optimizer base, Functional, data
# adapters, and the weight-file name helpers
from keras.src.losses import loss as loss_module
from keras.src.models.functional import Functional
from keras.src.optimizers import base_optimizer
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.utils import naming
from keras.src.utils.python_utils import is_default

__all__ = ["Distribution", "Functional", "KerasVariable", "TensorFlowTrainer", "any_symbolic_tensors",
           "base_optimizer", "data_adapter_utils", "distribution_lib", "global_state", "in_stateless_scope",
           "is_default", "loss_module", "naming", "tf_random"]
