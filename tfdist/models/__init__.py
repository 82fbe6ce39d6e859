"""Reference models in plain Keras 3, with ready tensor-parallel plans.

They use only stock Keras layers, so their plans are what a user would write
for their own model.
"""

from tfdist.models.gpt import GPT, GPTStage, gpt_tp_plan, parallelize_gpt, split_gpt
from tfdist.models.mlp import MLP, mlp_tp_plan

__all__ = ["MLP", "GPT", "GPTStage", "mlp_tp_plan", "gpt_tp_plan", "parallelize_gpt", "split_gpt"]
