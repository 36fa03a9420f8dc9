"""Moved to models.weights.collective_generator (issue 20: the weight path is one package); this
name stays for the importers outside that package until they import it from there."""

from models.weights.collective_generator import CollectiveWeightSink

__all__ = ["CollectiveWeightSink"]
