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
from tfdist.distributions.constraint_registry import biject_to, transform_to
from tfdist.distributions.transformed_distribution import TransformedDistribution
from tfdist.distributions._impl import (
    Bernoulli, Beta, Binomial, Categorical, Cauchy, Chi2, Dirichlet, Exponential, ExponentialFamily,
    Gamma, Geometric, Gumbel, HalfCauchy, HalfNormal, Independent, Laplace, LogNormal,
    MultivariateNormal, Normal, Pareto, Poisson, StudentT, Uniform, Weibull,
)
from tfdist.distributions._more import (
    ContinuousBernoulli, FisherSnedecor, InverseGamma, Kumaraswamy, LKJCholesky, LogitRelaxedBernoulli,
    LowRankMultivariateNormal, MixtureSameFamily, Multinomial, NegativeBinomial, OneHotCategorical,
    RelaxedBernoulli, RelaxedOneHotCategorical, VonMises, Wishart,
)
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.kl import kl_divergence, register_kl

__all__ = [
    "Distribution", "ExponentialFamily", "constraints", "kl_divergence", "register_kl",
    "transforms", "biject_to", "transform_to", "TransformedDistribution",
    "Bernoulli", "Beta", "Binomial", "Categorical", "Cauchy", "Chi2", "Dirichlet", "Exponential",
    "Gamma", "Geometric", "Gumbel", "HalfCauchy", "HalfNormal", "Independent", "Laplace",
    "LogNormal", "MultivariateNormal", "Normal", "Pareto", "Poisson", "StudentT", "Uniform", "Weibull",
    "ContinuousBernoulli", "FisherSnedecor", "InverseGamma", "Kumaraswamy", "LKJCholesky",
    "LogitRelaxedBernoulli", "LowRankMultivariateNormal", "MixtureSameFamily", "Multinomial",
    "NegativeBinomial", "OneHotCategorical", "RelaxedBernoulli", "RelaxedOneHotCategorical", "VonMises",
    "Wishart",
]
