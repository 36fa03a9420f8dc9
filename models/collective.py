"""Moved to models.weights.collective (issue 20: the weight path is one package); this name stays
for the importers outside that package until they import it from there."""

from models.weights.collective import *  # noqa: F403
from models.weights.collective import DEFAULT_PIPE_BYTES  # noqa: F401
