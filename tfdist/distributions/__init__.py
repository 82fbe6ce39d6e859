"""tfdist.distributions: the torch.distributions API on TensorFlow Probability.

Importing it imports TensorFlow Probability (``import tfdist`` alone does not).
Every distribution, KL pair, transform and constraint of torch.distributions'
documentation, with torch's names and parameterisations; see
docs/distributions.md.

Example:
    >>> from tfdist import distributions as D
    >>> D.kl_divergence(D.Normal(0.0, 1.0), D.Normal(1.0, 2.0)).numpy()
    0.44314718
"""

from tfdist.distributions import constraints, transforms
from tfdist.distributions.bernoulli import Bernoulli
from tfdist.distributions.beta import Beta
from tfdist.distributions.binomial import Binomial
from tfdist.distributions.categorical import Categorical
from tfdist.distributions.cauchy import Cauchy
from tfdist.distributions.chi2 import Chi2
from tfdist.distributions.constraint_registry import biject_to, transform_to
from tfdist.distributions.continuous_bernoulli import ContinuousBernoulli
from tfdist.distributions.dirichlet import Dirichlet
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.exp_family import ExponentialFamily
from tfdist.distributions.exponential import Exponential
from tfdist.distributions.fishersnedecor import FisherSnedecor
from tfdist.distributions.gamma import Gamma
from tfdist.distributions.geometric import Geometric
from tfdist.distributions.gumbel import Gumbel
from tfdist.distributions.half_cauchy import HalfCauchy
from tfdist.distributions.half_normal import HalfNormal
from tfdist.distributions.independent import Independent
from tfdist.distributions.inverse_gamma import InverseGamma
from tfdist.distributions.kl import kl_divergence, register_kl
from tfdist.distributions.kumaraswamy import Kumaraswamy
from tfdist.distributions.laplace import Laplace
from tfdist.distributions.lkj_cholesky import LKJCholesky
from tfdist.distributions.log_normal import LogNormal
from tfdist.distributions.logistic_normal import LogisticNormal
from tfdist.distributions.lowrank_multivariate_normal import LowRankMultivariateNormal
from tfdist.distributions.mixture_same_family import MixtureSameFamily
from tfdist.distributions.multinomial import Multinomial
from tfdist.distributions.multivariate_normal import MultivariateNormal
from tfdist.distributions.negative_binomial import NegativeBinomial
from tfdist.distributions.normal import Normal
from tfdist.distributions.one_hot_categorical import (
    OneHotCategorical,
    OneHotCategoricalStraightThrough,
)
from tfdist.distributions.pareto import Pareto
from tfdist.distributions.poisson import Poisson
from tfdist.distributions.relaxed_bernoulli import (
    LogitRelaxedBernoulli,
    RelaxedBernoulli,
)
from tfdist.distributions.relaxed_categorical import RelaxedOneHotCategorical
from tfdist.distributions.studentT import StudentT
from tfdist.distributions.transformed_distribution import TransformedDistribution
from tfdist.distributions.transforms import *  # noqa: F403  (torch re-exports every transform here)
from tfdist.distributions.uniform import Uniform
from tfdist.distributions.von_mises import VonMises
from tfdist.distributions.weibull import Weibull
from tfdist.distributions.wishart import Wishart

__all__ = [
    "Distribution", "ExponentialFamily", "constraints", "kl_divergence", "register_kl",
    "transforms", "biject_to", "transform_to", "TransformedDistribution",
    "Bernoulli", "Beta", "Binomial", "Categorical", "Cauchy", "Chi2", "Dirichlet", "Exponential",
    "Gamma", "Geometric", "Gumbel", "HalfCauchy", "HalfNormal", "Independent", "Laplace",
    "LogNormal", "MultivariateNormal", "Normal", "Pareto", "Poisson", "StudentT", "Uniform", "Weibull",
    "ContinuousBernoulli", "FisherSnedecor", "InverseGamma", "Kumaraswamy", "LKJCholesky",
    "LogitRelaxedBernoulli", "LowRankMultivariateNormal", "MixtureSameFamily", "Multinomial",
    "NegativeBinomial", "OneHotCategorical", "RelaxedBernoulli", "RelaxedOneHotCategorical", "VonMises",
    "Wishart", "LogisticNormal", "OneHotCategoricalStraightThrough",
] + list(transforms.__all__)
