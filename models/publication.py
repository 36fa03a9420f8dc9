"""Moved to models.weights.publication (issue 20: the weight path is one package); this name stays
for the importers outside that package until they import it from there."""

from models.weights.publication import *  # noqa: F403
from models.weights.publication import __all__  # noqa: F401
