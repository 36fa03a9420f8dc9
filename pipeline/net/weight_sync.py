"""Moved to models.weights.chunked (issue 20: the weight path is one package); this name stays for
the importers outside that package until they import it from there."""

from models.weights.chunked import WeightPublisher, WeightReceiver, WeightSyncError
from models.weights.verified import VerifiedWeights

__all__ = ["VerifiedWeights", "WeightPublisher", "WeightReceiver", "WeightSyncError"]
