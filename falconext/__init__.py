"""falconext: find and fix fail-slows inside running Megatron-LM training jobs.

The pipeline is track -> profile -> validate -> plan -> mitigate; each phase lives in the
sub-package named after it (README.md, "Where things are: the phases and their folders";
the design in docs/).
"""

from falconext.config import ConfigError, FalconConfig

__all__ = ["FalconConfig", "ConfigError", "__version__"]
__version__ = "0.1.0"
