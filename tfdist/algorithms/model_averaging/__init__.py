"""Model averaging (torch.distributed.algorithms.model_averaging): ``averagers.PeriodicModelAverager``
and ``utils.average_parameters``, for the replicas ``DistributedDataParallel`` keeps."""

from tfdist.algorithms.model_averaging import averagers, utils

__all__ = ["averagers", "utils"]
